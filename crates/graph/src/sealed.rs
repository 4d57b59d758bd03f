//! Encrypted cluster connections (`placement.encrypt`): every byte a
//! process sends another, on timely's sockets and on the direct weights
//! channel, sealed with AES-256-GCM.
//!
//! Keys. Each connection's handshake already exchanges a fresh 32-byte
//! value from each side; those values are X25519 public keys of keys made
//! for that connection alone ([`KeyShare`]). Once both sides have proven
//! the cluster secret, each computes the X25519 shared value and derives
//! two keys with HKDF-SHA256 over the secret and the shared value, bound to
//! the handshake (both processes, both public keys, what the connection is
//! for): one for each direction. So
//! - nobody without the secret can read or forge a frame, even one who
//!   sits between the processes and rewrites the handshake (the keys mix
//!   in the secret, and a rewritten public key gives other keys);
//! - traffic recorded today stays unreadable to whoever learns the secret
//!   later (the X25519 keys are forgotten when the handshake ends);
//! - no two connections share a key, so each direction numbers its frames
//!   from zero, and the number is the AES-GCM nonce.
//!
//! Frames. A frame is its plaintext length (4 bytes, little-endian, at
//! most [`MAX_FRAME`]), then the ciphertext and its 16-byte tag; the
//! length is authenticated as associated data and the frame number as the
//! nonce, so a frame that is changed, dropped, repeated or reordered fails
//! to open and the connection is given up with an error. A peer ending the
//! connection between two frames is an end of stream, as on a plain socket.
//!
//! [`Sealed`] is a `Read` + `Write` over a `TcpStream`, and timely's
//! `Stream` (timely takes any such stream for its cluster's connections);
//! its clones share the two directions' state, so timely's sending and
//! receiving threads each use their own clone.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::agreement::{agree_ephemeral, EphemeralPrivateKey, UnparsedPublicKey, X25519};
use ring::hkdf::{Salt, HKDF_SHA256};
use ring::rand::SystemRandom;

use crate::{ClusterSecret, GraphError};

/// The most plaintext bytes one frame carries.
pub(crate) const MAX_FRAME: usize = 256 << 10;
const TAG: usize = 16;
const HEADER: usize = 4;

/// This side's half of a connection's key exchange: an X25519 key made for
/// this connection; its public half is the handshake's fresh value.
pub(crate) struct KeyShare {
    private: EphemeralPrivateKey,
    public: [u8; 32],
}

impl KeyShare {
    /// A fresh key share from the operating system's random source.
    pub(crate) fn new() -> Result<Self, GraphError> {
        let fail = |_| GraphError::Runtime("making a connection's X25519 key".into());
        let private = EphemeralPrivateKey::generate(&X25519, &SystemRandom::new()).map_err(fail)?;
        let public = private
            .compute_public_key()
            .map_err(fail)?
            .as_ref()
            .try_into()
            .expect("an X25519 public key has 32 bytes");
        Ok(KeyShare { private, public })
    }

    /// The public half: what the handshake sends.
    pub(crate) fn public(&self) -> &[u8; 32] {
        &self.public
    }

    /// The two directions' keys of a connection whose other side sent
    /// `theirs`, under `secret`. `context` names the connection (what it is
    /// for, both parties, anything else both sides agree on), and
    /// `initiator` says whether this side opened it (so that both sides
    /// order the two public halves, and the two directions, alike).
    pub(crate) fn keys(
        self,
        theirs: &[u8; 32],
        secret: &ClusterSecret,
        context: &[u8],
        initiator: bool,
    ) -> Result<SessionKeys, GraphError> {
        let (initiator_public, responder_public) = if initiator {
            (self.public, *theirs)
        } else {
            (*theirs, self.public)
        };
        let peer = UnparsedPublicKey::new(&X25519, theirs);
        let derive = |shared: &[u8]| -> Result<SessionKeys, ring::error::Unspecified> {
            let mut ikm = Vec::with_capacity(secret.key().len() + shared.len());
            ikm.extend_from_slice(secret.key());
            ikm.extend_from_slice(shared);
            let prk = Salt::new(HKDF_SHA256, SALT).extract(&ikm);
            let key = |direction: &[u8]| -> Result<LessSafeKey, ring::error::Unspecified> {
                let info = [
                    direction,
                    &initiator_public[..],
                    &responder_public[..],
                    context,
                ];
                let okm = prk.expand(&info, &AES_256_GCM)?;
                Ok(LessSafeKey::new(UnboundKey::from(okm)))
            };
            let (outbound, inbound) = (
                key(b"initiator to responder")?,
                key(b"responder to initiator")?,
            );
            Ok(if initiator {
                SessionKeys {
                    send: outbound,
                    receive: inbound,
                }
            } else {
                SessionKeys {
                    send: inbound,
                    receive: outbound,
                }
            })
        };
        agree_ephemeral(self.private, &peer, derive)
            .and_then(|keys| keys)
            .map_err(|_| {
                GraphError::Execution("a peer's key share is not a valid X25519 public key".into())
            })
    }
}

const SALT: &[u8] = b"weir sealed connection v1";

/// A connection's two keys: for what this side sends, and for what it receives.
pub(crate) struct SessionKeys {
    send: LessSafeKey,
    receive: LessSafeKey,
}

/// One direction's state: its key, the next frame's number, and a buffer.
struct Direction {
    key: LessSafeKey,
    frame: u64,
    buffer: Vec<u8>,
    /// Received plaintext not yet read: `buffer[start..end]`.
    start: usize,
    end: usize,
    /// Set by an error mid-frame: the stream's framing is lost.
    broken: bool,
}

impl Direction {
    fn new(key: LessSafeKey) -> Self {
        Direction {
            key,
            frame: 0,
            buffer: Vec::new(),
            start: 0,
            end: 0,
            broken: false,
        }
    }

    /// The next frame's nonce (its number), or an error once numbers run out.
    fn next_nonce(&mut self) -> io::Result<Nonce> {
        let number = self.frame;
        self.frame = number
            .checked_add(1)
            .ok_or_else(|| io::Error::other("a sealed connection ran out of frame numbers"))?;
        let mut nonce = [0u8; NONCE_LEN];
        nonce[NONCE_LEN - 8..].copy_from_slice(&number.to_be_bytes());
        Ok(Nonce::assume_unique_for_key(nonce))
    }
}

/// An encrypted connection over a `TcpStream` (see the module's documentation).
pub(crate) struct Sealed {
    socket: TcpStream,
    send: Arc<Mutex<Direction>>,
    receive: Arc<Mutex<Direction>>,
}

fn lock(direction: &Mutex<Direction>) -> MutexGuard<'_, Direction> {
    direction.lock().unwrap_or_else(|p| p.into_inner())
}

fn broken() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "a sealed connection failed mid-frame and was given up",
    )
}

impl Sealed {
    /// `socket`, sealed under `keys`.
    pub(crate) fn new(socket: TcpStream, keys: SessionKeys) -> Self {
        Sealed {
            socket,
            send: Arc::new(Mutex::new(Direction::new(keys.send))),
            receive: Arc::new(Mutex::new(Direction::new(keys.receive))),
        }
    }

    /// Reads and opens the next frame: straight into `out` when it has room
    /// for the frame and its tag (a payload landing in its buffer crosses
    /// no buffer of ours), into `receive`'s buffer otherwise.
    fn next_frame(&self, receive: &mut Direction, out: &mut [u8]) -> io::Result<Opened> {
        let mut header = [0u8; HEADER];
        let mut got = 0;
        while got < HEADER {
            match (&self.socket).read(&mut header[got..]) {
                Ok(0) if got == 0 => return Ok(Opened::End),
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "a sealed connection ended inside a frame",
                    ))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let length = u32::from_le_bytes(header) as usize;
        if length == 0 || length > MAX_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a sealed frame announces {length} bytes (1 to {MAX_FRAME} are sent)"),
            ));
        }
        let nonce = receive.next_nonce()?;
        let direct = out.len() >= length + TAG;
        let Direction { key, buffer, .. } = receive;
        let sealed: &mut [u8] = if direct {
            &mut out[..length + TAG]
        } else {
            buffer.resize(length + TAG, 0);
            buffer
        };
        (&self.socket).read_exact(sealed)?;
        key.open_in_place(nonce, Aad::from(header), sealed)
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a frame from the peer failed authentication (changed on the way, or sealed \
                     under another cluster secret)",
                )
            })?;
        if direct {
            return Ok(Opened::Into(length));
        }
        receive.start = 0;
        receive.end = length;
        Ok(Opened::Buffered)
    }
}

/// Where [`Sealed::next_frame`] put a frame's plaintext.
enum Opened {
    /// In the caller's buffer, this many bytes.
    Into(usize),
    /// In the direction's buffer.
    Buffered,
    /// Nowhere: the peer ended the connection between two frames.
    End,
}

impl Read for Sealed {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let receive = self.receive.clone();
        let mut receive = lock(&receive);
        if receive.broken {
            return Err(broken());
        }
        if receive.start == receive.end {
            match self.next_frame(&mut receive, out) {
                Ok(Opened::Into(n)) => return Ok(n),
                Ok(Opened::Buffered) => {}
                Ok(Opened::End) => return Ok(0),
                Err(e) => {
                    receive.broken = true;
                    return Err(e);
                }
            }
        }
        let n = out.len().min(receive.end - receive.start);
        out[..n].copy_from_slice(&receive.buffer[receive.start..receive.start + n]);
        receive.start += n;
        Ok(n)
    }
}

impl Write for Sealed {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        let mut send = lock(&self.send);
        if send.broken {
            return Err(broken());
        }
        let n = data.len().min(MAX_FRAME);
        let header = (n as u32).to_le_bytes();
        let nonce = send.next_nonce()?;
        let Direction { key, buffer, .. } = &mut *send;
        buffer.clear();
        buffer.extend_from_slice(&header);
        buffer.extend_from_slice(&data[..n]);
        let tag = key
            .seal_in_place_separate_tag(nonce, Aad::from(header), &mut buffer[HEADER..])
            .map_err(|_| io::Error::other("sealing a frame"))?;
        buffer.extend_from_slice(tag.as_ref());
        if let Err(e) = (&self.socket).write_all(buffer) {
            send.broken = true;
            return Err(e);
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&self.socket).flush()
    }
}

impl timely::communication::allocator::zero_copy::stream::Stream for Sealed {
    fn try_clone(&self) -> io::Result<Self> {
        Ok(Sealed {
            socket: self.socket.try_clone()?,
            send: self.send.clone(),
            receive: self.receive.clone(),
        })
    }

    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        if nonblocking {
            // A frame half written or half read cannot be resumed.
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a sealed connection is blocking only",
            ));
        }
        self.socket.set_nonblocking(false)
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.socket.shutdown(how)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connected pair of plain sockets.
    fn sockets() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (a, listener.accept().unwrap().0)
    }

    /// One connection's keys: the opening side's under `secret`, the other
    /// side's under `theirs`.
    fn keys(secret: &str, theirs: &str) -> (SessionKeys, SessionKeys) {
        let (share_a, share_b) = (KeyShare::new().unwrap(), KeyShare::new().unwrap());
        let (public_a, public_b) = (*share_a.public(), *share_b.public());
        let secret = ClusterSecret::new(secret).unwrap();
        let theirs = ClusterSecret::new(theirs).unwrap();
        (
            share_a.keys(&public_b, &secret, b"test", true).unwrap(),
            share_b.keys(&public_a, &theirs, b"test", false).unwrap(),
        )
    }

    /// A connected pair of sealed streams under `secret` (and the far
    /// side's under `theirs`).
    fn pair(secret: &str, theirs: &str) -> (Sealed, Sealed) {
        let ((a, b), (keys_a, keys_b)) = (sockets(), keys(secret, theirs));
        (Sealed::new(a, keys_a), Sealed::new(b, keys_b))
    }

    /// A sealed sender whose frames a `tap` reads raw, and the receiver with
    /// the matching keys whose bytes a `forger` writes raw.
    struct Tapped {
        sender: Sealed,
        tap: TcpStream,
        receiver: Sealed,
        forger: TcpStream,
    }

    fn tapped() -> Tapped {
        let ((raw, tap), (forger, into)) = (sockets(), sockets());
        let (send, receive) = keys("s", "s");
        Tapped {
            sender: Sealed::new(raw, send),
            tap,
            receiver: Sealed::new(into, receive),
            forger,
        }
    }

    #[test]
    fn bytes_cross_whole_in_both_directions_and_unreadable_on_the_wire() {
        let (mut a, mut b) = pair("s3cret", "s3cret");
        let message: Vec<u8> = (0..3 * MAX_FRAME + 17).map(|i| (i % 251) as u8).collect();
        let sent = message.clone();
        let writer = std::thread::spawn(move || {
            a.write_all(&sent).unwrap();
            let mut back = [0u8; 5];
            a.read_exact(&mut back).unwrap();
            back
        });
        let mut got = vec![0u8; message.len()];
        b.read_exact(&mut got).unwrap();
        assert!(got == message, "the payload arrives unchanged");
        b.write_all(b"thank").unwrap();
        assert_eq!(&writer.join().unwrap(), b"thank");
    }

    #[test]
    fn what_crosses_the_wire_is_not_the_plaintext() {
        let Tapped {
            mut sender,
            mut tap,
            ..
        } = tapped();
        let plain = b"the learner's weights, in clear".repeat(8);
        sender.write_all(&plain).unwrap();
        let mut wire = vec![0u8; HEADER + plain.len() + TAG];
        tap.read_exact(&mut wire).unwrap();
        assert!(!wire.windows(16).any(|w| plain.windows(16).any(|p| p == w)));
    }

    #[test]
    fn another_secret_or_a_changed_frame_fails_to_open() {
        let (mut a, mut b) = pair("s3cret", "guess");
        a.write_all(b"hello").unwrap();
        let err = b.read(&mut [0u8; 5]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("failed authentication"), "{err}");
        // The stream is given up after it.
        assert_eq!(
            b.read(&mut [0u8; 5]).unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );

        // A frame changed on the way (one bit of its ciphertext).
        let Tapped {
            mut sender,
            mut tap,
            mut receiver,
            mut forger,
        } = tapped();
        sender.write_all(b"twelve bytes").unwrap();
        let mut frame = vec![0u8; HEADER + 12 + TAG];
        tap.read_exact(&mut frame).unwrap();
        frame[HEADER + 3] ^= 1;
        // Replay it, changed, to a receiver with the right keys.
        forger.write_all(&frame).unwrap();
        // Read into a buffer with room for the frame: opened in place there.
        let err = receiver.read(&mut [0u8; 64]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_replayed_or_oversized_frame_is_refused() {
        let Tapped {
            mut sender,
            mut tap,
            mut receiver,
            mut forger,
        } = tapped();
        sender.write_all(b"once").unwrap();
        let mut frame = vec![0u8; HEADER + 4 + TAG];
        tap.read_exact(&mut frame).unwrap();
        forger.write_all(&frame).unwrap();
        forger.write_all(&frame).unwrap();
        let mut got = [0u8; 4];
        receiver.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"once");
        let err = receiver.read(&mut got).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "the replay: {err}");

        let Tapped {
            mut receiver,
            mut forger,
            ..
        } = tapped();
        forger.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let err = receiver.read(&mut got).unwrap_err();
        assert!(
            err.to_string().contains("announces 4294967295 bytes"),
            "{err}"
        );
    }

    #[test]
    fn a_peer_closing_between_frames_is_an_end_of_stream() {
        let (a, mut b) = pair("s", "s");
        drop(a);
        assert_eq!(b.read(&mut [0u8; 8]).unwrap(), 0);
    }

    #[test]
    fn a_public_key_that_is_not_a_point_is_refused() {
        let share = KeyShare::new().unwrap();
        // X25519 accepts any 32 bytes but the all-zero point gives an all-zero
        // shared value, which ring refuses.
        let err = share
            .keys(&[0u8; 32], &ClusterSecret::new("s").unwrap(), b"c", true)
            .err()
            .expect("refused");
        assert!(err.to_string().contains("X25519"), "{err}");
    }
}
