//! Connections accepted but not yet proven: how many a server holds, and
//! which one goes when a new one comes.
//!
//! Anyone who can reach a port can open connections to it. A server that
//! answers them first come, first served, or turns new ones away once its
//! handshake slots are taken, lets idle or half-open sockets lock a
//! legitimate peer out. So the cluster listener and the weights server
//! keep their unproven connections in an [`Unproven`] table instead:
//! - every new connection is taken in, and a full table makes room by
//!   closing its **oldest** unproven connection (of the same source first,
//!   when that source holds its share): a peer that connects now is never
//!   turned away by sockets that were opened before it and said nothing;
//! - a connection has [`GREETING`] to prove itself before it is closed;
//! - one that proves the secret ([`Ticket::proven`]) leaves the table and
//!   can no longer be closed by it.
//!
//! A legitimate connection is then delayed by strays only as long as its
//! own handshake takes, and by nothing at all unless a stray opens
//! [`MAX_UNPROVEN`] connections in that time — and even then its dial
//! retries until its deadline.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Unproven connections held at once, from all sources.
pub(crate) const MAX_UNPROVEN: usize = 64;
/// Unproven connections held at once from one address.
pub(crate) const MAX_PER_SOURCE: usize = 16;
/// How long an accepted connection has to prove the secret.
pub(crate) const GREETING: Duration = Duration::from_secs(2);

/// The table of unproven connections a server holds.
#[derive(Clone, Default)]
pub(crate) struct Unproven {
    entries: Arc<Mutex<Vec<Entry>>>,
}

struct Entry {
    id: u64,
    source: IpAddr,
    /// A handle of the connection's socket, to close it from here.
    socket: TcpStream,
}

/// A connection's place in the table: it leaves when the ticket is proven
/// or dropped.
pub(crate) struct Ticket {
    id: u64,
    table: Unproven,
}

impl Unproven {
    /// Takes `stream` (from `from`) in, closing the oldest unproven
    /// connection when the table or `from`'s share of it is full; returns
    /// the new connection's ticket, and the address closed to make room.
    pub(crate) fn admit(
        &self,
        stream: &TcpStream,
        from: SocketAddr,
    ) -> (Ticket, Option<SocketAddr>) {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let same = entries.iter().filter(|e| e.source == from.ip()).count();
        let evict = if same >= MAX_PER_SOURCE {
            entries.iter().position(|e| e.source == from.ip())
        } else if entries.len() >= MAX_UNPROVEN {
            Some(0)
        } else {
            None
        };
        // Entries are kept in the order they came: the first is the oldest.
        let closed = evict.map(|at| {
            let old = entries.remove(at);
            let _ = old.socket.shutdown(std::net::Shutdown::Both);
            old.socket
                .peer_addr()
                .unwrap_or(SocketAddr::new(old.source, 0))
        });
        if let Ok(socket) = stream.try_clone() {
            entries.push(Entry {
                id,
                source: from.ip(),
                socket,
            });
        }
        let ticket = Ticket {
            id,
            table: self.clone(),
        };
        (ticket, closed)
    }

    /// Unproven connections held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn remove(&self, id: u64) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|e| e.id != id);
    }
}

impl Ticket {
    /// The connection proved the secret: it leaves the table.
    pub(crate) fn proven(self) {}
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.table.remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    #[test]
    fn a_full_table_closes_its_oldest_connection_and_a_source_its_own() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let table = Unproven::default();
        let mut clients = Vec::new();
        let mut tickets = Vec::new();
        for _ in 0..MAX_PER_SOURCE + 3 {
            clients.push(TcpStream::connect(address).unwrap());
            let (accepted, from) = listener.accept().unwrap();
            let (ticket, closed) = table.admit(&accepted, from);
            tickets.push((ticket, accepted));
            assert_eq!(closed.is_some(), tickets.len() > MAX_PER_SOURCE);
        }
        assert_eq!(table.len(), MAX_PER_SOURCE);
        // The first three clients (the oldest) were closed; the newest was not.
        let mut byte = [0u8; 1];
        for client in &mut clients[..3] {
            client
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            assert_eq!(client.read(&mut byte).unwrap(), 0, "closed");
        }
        let newest = clients.last_mut().unwrap();
        newest
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        assert!(
            newest.read(&mut byte).is_err(),
            "still open (no data, no EOF)"
        );
        // A proven connection leaves the table for good.
        let (ticket, _stream) = tickets.pop().unwrap();
        ticket.proven();
        assert_eq!(table.len(), MAX_PER_SOURCE - 1);
    }
}
