//! TensorBoard event files: scalars written step by step, so that
//! `tensorboard --logdir runs/` shows a run's metrics while it trains.
//!
//! An event file is a sequence of TFRecords (`u64` length, its masked
//! CRC-32C, the bytes, their masked CRC-32C), each holding an `Event`
//! protocol buffer: the first `file_version = "brain.Event:2"`, then one
//! per step with a `Summary` of `(tag, simple_value)` pairs. The few
//! protobuf fields are encoded here by hand; [`read_scalars`] decodes them
//! again (tests, and `weir` itself never needs more). [`step_observer`]
//! writes a run's metrics through `RunSettings::observe_steps`.
//!
//! # Examples
//! ```
//! use weir_graph::tensorboard::{read_scalars, EventWriter};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let mut w = EventWriter::create(dir.path()).unwrap();
//! w.scalars(3, 1.5e9, &[("learn/loss".into(), 0.25)]).unwrap();
//! let back = read_scalars(w.path()).unwrap();
//! assert_eq!(back, vec![(3, "learn/loss".to_string(), 0.25)]);
//! ```

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::GraphError;

/// Appends events to one event file.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// A new event file in `dir` (created if missing), named as TensorBoard
    /// expects: `events.out.tfevents.<unix seconds>.<host>.<pid>`.
    pub fn create(dir: &Path) -> Result<Self, GraphError> {
        std::fs::create_dir_all(dir).map_err(|e| GraphError::io(dir, e))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "weir".into());
        // A second writer of the same process and second gets a suffix
        // rather than truncating the first one's file.
        let base = format!(
            "events.out.tfevents.{}.{host}.{}",
            now.as_secs(),
            std::process::id()
        );
        let (path, file) = (0..)
            .map(|n| match n {
                0 => dir.join(&base),
                n => dir.join(format!("{base}.{n}")),
            })
            .find_map(|path| {
                match std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                {
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                    opened => Some(
                        opened
                            .map(|f| (path.clone(), f))
                            .map_err(|e| GraphError::io(&path, e)),
                    ),
                }
            })
            .expect("an unused file name")?;
        let mut writer = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        let mut event = Vec::new();
        field_double(&mut event, 1, now.as_secs_f64());
        field_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        writer.flush()?;
        Ok(writer)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event with `values` as scalars of `step`, and flushes.
    pub fn scalars(
        &mut self,
        step: u64,
        wall_time: f64,
        values: &[(String, f64)],
    ) -> Result<(), GraphError> {
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut v = Vec::new();
            field_bytes(&mut v, 1, tag.as_bytes());
            v.push(0x15); // field 2, 32-bit: simple_value
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            field_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        field_double(&mut event, 1, wall_time);
        event.push(0x10); // field 2, varint: step
        varint(&mut event, step);
        field_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.flush()
    }

    fn record(&mut self, data: &[u8]) -> Result<(), GraphError> {
        let len = (data.len() as u64).to_le_bytes();
        let mut bytes = Vec::with_capacity(data.len() + 16);
        bytes.extend_from_slice(&len);
        bytes.extend_from_slice(&masked_crc(&len).to_le_bytes());
        bytes.extend_from_slice(data);
        bytes.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out
            .write_all(&bytes)
            .map_err(|e| GraphError::io(&self.path, e))
    }

    fn flush(&mut self) -> Result<(), GraphError> {
        self.out.flush().map_err(|e| GraphError::io(&self.path, e))
    }
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn field_double(out: &mut Vec<u8>, field: u64, v: f64) {
    varint(out, (field << 3) | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

/// Writes each step's metrics to a TensorBoard event file under `dir`
/// (`tensorboard --logdir runs/`): tag `stage/metric[/label]`, the mean
/// over the workers that reported it. A failure to write is logged once
/// and never stops the run.
pub fn step_observer(dir: &Path) -> crate::StepObserver {
    let dir = dir.to_path_buf();
    let writer: std::sync::Mutex<Option<Result<EventWriter, ()>>> = std::sync::Mutex::new(None);
    std::sync::Arc::new(move |step, rows: &[crate::metrics::MetricRow]| {
        let mut writer = writer.lock().unwrap_or_else(|e| e.into_inner());
        let w = writer.get_or_insert_with(|| {
            EventWriter::create(&dir).map_err(|e| {
                tracing::warn!(error = %e, "TensorBoard events are not written");
            })
        });
        let Ok(w) = w else { return };
        let mut sums: std::collections::BTreeMap<String, (f64, f64)> = Default::default();
        let mut wall = 0.0f64;
        for r in rows {
            if r.metric == crate::metrics::names::DONE_UNIX_S {
                wall = wall.max(r.value);
                continue;
            }
            let tag = match &r.label {
                Some(label) => format!("{}/{}/{label}", r.stage, r.metric),
                None => format!("{}/{}", r.stage, r.metric),
            };
            let e = sums.entry(tag).or_default();
            (e.0, e.1) = (e.0 + r.value, e.1 + 1.0);
        }
        if wall == 0.0 {
            wall = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
        }
        let values: Vec<(String, f64)> = sums.into_iter().map(|(k, (s, n))| (k, s / n)).collect();
        if let Err(e) = w.scalars(step, wall, &values) {
            tracing::warn!(error = %e, "TensorBoard events are no longer written");
            *writer = Some(Err(()));
        }
    })
}

/// CRC-32C (Castagnoli), bitwise-reflected, as TFRecord uses it.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// Every scalar of an event file as `(step, tag, value)`, checking each
/// record's checksums.
pub fn read_scalars(path: &Path) -> Result<Vec<(u64, String, f64)>, GraphError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| GraphError::io(path, e))?;
    let bad = |what: &str| GraphError::Codec(format!("{}: {what}", path.display()));
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad("truncated record"))?;
        let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
        if masked_crc(&header[..8]).to_le_bytes() != header[8..12] {
            return Err(bad("length checksum"));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| bad("truncated record"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| bad("truncated record"))?;
        if masked_crc(data).to_le_bytes() != crc {
            return Err(bad("data checksum"));
        }
        at += 16 + len;
        let mut step = 0;
        for (field, value) in fields(data).ok_or_else(|| bad("not an Event"))? {
            match (field, value) {
                (2, Field::Varint(s)) => step = s,
                (5, Field::Bytes(summary)) => {
                    for (_, v) in fields(summary).ok_or_else(|| bad("not a Summary"))? {
                        let Field::Bytes(v) = v else { continue };
                        let (mut tag, mut value) = (String::new(), f64::NAN);
                        for (f, x) in fields(v).ok_or_else(|| bad("not a Value"))? {
                            match (f, x) {
                                (1, Field::Bytes(t)) => tag = String::from_utf8_lossy(t).into(),
                                (2, Field::Fixed32(b)) => value = f64::from(f32::from_le_bytes(b)),
                                // Protobuf: a reader skips the fields it does not read.
                                _ => {}
                            }
                        }
                        out.push((step, tag, value));
                    }
                }
                // Protobuf: a reader skips the fields it does not read.
                _ => {}
            }
        }
    }
    Ok(out)
}

enum Field<'a> {
    Varint(u64),
    Fixed64,
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

/// The top-level fields of a protobuf message.
fn fields(mut data: &[u8]) -> Option<Vec<(u64, Field<'_>)>> {
    fn read_varint(data: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = data.split_first()?;
            *data = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Some(v);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = read_varint(&mut data)?;
        let value = match key & 7 {
            0 => Field::Varint(read_varint(&mut data)?),
            1 => {
                data = data.get(8..)?;
                Field::Fixed64
            }
            2 => {
                let len = read_varint(&mut data)? as usize;
                let (bytes, rest) = (data.get(..len)?, data.get(len..)?);
                data = rest;
                Field::Bytes(bytes)
            }
            5 => {
                let b: [u8; 4] = data.get(..4)?.try_into().ok()?;
                data = &data[4..];
                Field::Fixed32(b)
            }
            _ => return None,
        };
        out.push((key >> 3, value));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_of_the_standard_check_string() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn scalars_read_back_in_order_and_corruption_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        assert!(w
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("events.out.tfevents."));
        for step in 0..3u64 {
            w.scalars(
                step,
                1.7e9 + step as f64,
                &[
                    ("learn/loss".into(), 0.5 / (step + 1) as f64),
                    ("reward/reward".into(), step as f64),
                ],
            )
            .unwrap();
        }
        let back = read_scalars(w.path()).unwrap();
        assert_eq!(back.len(), 6);
        assert_eq!(back[2], (1, "learn/loss".to_string(), 0.25));
        assert_eq!(back[5], (2, "reward/reward".to_string(), 2.0));
        let mut bytes = std::fs::read(w.path()).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 0xff;
        std::fs::write(w.path(), bytes).unwrap();
        assert!(read_scalars(w.path()).is_err());
    }
}
