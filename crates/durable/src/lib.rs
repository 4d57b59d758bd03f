//! # weir-durable: every file weir writes, written one way; side files read within a bound
//!
//! A run folder outlives crashes and may sit where other users can write
//! (a shared scratch disk, `/tmp`). So every file weir writes — checkpoints,
//! `state.json`, the rollout log, metrics, exports, plots — is written the
//! same way:
//! - to a temporary file created **exclusively** (`O_CREAT | O_EXCL`, so a
//!   link planted under the name is never followed) under a **random name**
//!   in the target's own folder (so nobody can plant it in advance);
//! - synced to disk, then **renamed** over the target (a rename replaces a
//!   link planted at the target; it never writes through it);
//! - with the folder synced after the rename, so a power cut leaves the old
//!   file or the whole new one.
//!
//! Errors are [`std::io::Error`]s about the *target*: callers name the
//! user's path, never the temporary one, which is removed on failure.
//!
//! The small files a user or a checkpoint gives (`config.json`,
//! `tokenizer.json`, `state.json`, a config) are read with
//! [`read_capped`]: a file past its bound is refused from its length
//! before a byte is read, so a sparse multi-gigabyte file costs nothing.
//!
//! ```
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("state.json");
//! weir_durable::write(&path, b"{}").unwrap();
//! assert_eq!(std::fs::read(&path).unwrap(), b"{}");
//! ```

#![deny(missing_docs)]

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Writes `bytes` to `path` (see the crate's caption for how).
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(path, |file| file.write_all(bytes))
}

/// Writes `path` through `fill`, which gets the exclusive temporary file to
/// write into; the file is synced and renamed over `path` once `fill`
/// returns `Ok`, and removed otherwise.
pub fn write_with(path: &Path, fill: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
    // Never the target's extension: a folder reader that picks files by
    // it (`*.parquet`) must not take a temporary for a file.
    let mut temporary = temporary_beside(path, ".tmp")?;
    fill(temporary.as_file_mut())?;
    commit(temporary, path)
}

/// Writes `path` through `fill`, which gets the path of a fresh, empty
/// temporary file that only this call created, for writers that open a
/// path themselves (an image encoder). The file is then synced and renamed
/// over `path`. The temporary's name ends in `path`'s extension, for
/// writers that choose a format by it.
pub fn write_through_path(
    path: &Path,
    fill: impl FnOnce(&Path) -> io::Result<()>,
) -> io::Result<()> {
    let extension = path.extension().map(|e| e.to_string_lossy());
    let suffix = extension.map_or(".tmp".to_string(), |e| format!(".tmp.{e}"));
    let temporary = temporary_beside(path, &suffix)?;
    fill(temporary.path())?;
    commit(temporary, path)
}

/// Copies the file `from` to `to` (see the crate's caption for how `to` is
/// written). Errors name neither path: the caller knows which one it was.
pub fn copy(from: &Path, to: &Path) -> io::Result<()> {
    let mut source = File::open(from)?;
    write_with(to, |file| io::copy(&mut source, file).map(|_| ()))
}

/// The most bytes a side file of a checkpoint or a run folder may hold
/// (`config.json`, `tokenizer_config.json`, `generation_config.json`,
/// `state.json`, a chat template, a run's config): far above any real one.
pub const SIDE_FILE_BYTES: u64 = 64 << 20;

/// The most bytes a `tokenizer.json` may hold (the largest released ones
/// hold about 35 MB).
pub const TOKENIZER_BYTES: u64 = 512 << 20;

/// Reads the file at `path` whole when it holds at most `cap` bytes; a
/// larger one is refused from its length, before anything is read or
/// allocated (an error of kind [`io::ErrorKind::FileTooLarge`] saying both
/// sizes). A file that grows while it is read is cut at `cap + 1` bytes
/// and refused the same way.
pub fn read_capped(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let file = File::open(path)?;
    let too_large = |bytes: u64| {
        io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!(
                "{} bytes, more than the {} such a file may hold",
                bytes, cap
            ),
        )
    };
    let length = file.metadata()?.len();
    if length > cap {
        return Err(too_large(length));
    }
    let mut bytes = Vec::with_capacity(length as usize);
    file.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text_capped(path: &Path, cap: u64) -> io::Result<String> {
    String::from_utf8(read_capped(path, cap)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Syncs the folder `dir` to disk (its entries: creations and renames).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    File::open(dir)?.sync_all()
}

/// An exclusive temporary file with a random name in `path`'s folder,
/// created with the permissions a plain create would give (0666 less the
/// umask), not the 0600 of a private temporary.
fn temporary_beside(path: &Path, suffix: &str) -> io::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt;
    let dir = folder_of(path);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(suffix)
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(dir)
}

fn commit(temporary: tempfile::NamedTempFile, path: &Path) -> io::Result<()> {
    temporary.as_file().sync_all()?;
    temporary.persist(path).map_err(|e| e.error)?;
    sync_dir(folder_of(path))
}

fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_link_at_the_target_is_replaced_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = dir.path().join("out.jsonl");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        write(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(!std::fs::symlink_metadata(&path).unwrap().is_symlink());
    }

    #[test]
    fn links_planted_at_the_old_temporary_names_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = dir.path().join("out.jsonl");
        for planted in ["out.tmp", "out.jsonl.tmp", ".out.jsonl.tmp"] {
            std::os::unix::fs::symlink(&victim, dir.path().join(planted)).unwrap();
        }
        write(&path, b"new").unwrap();
        copy(&path, &dir.path().join("copy")).unwrap();
        write_through_path(&dir.path().join("out.png"), |p| std::fs::write(p, b"img")).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(dir.path().join("copy")).unwrap(), b"new");
        assert_eq!(std::fs::read(dir.path().join("out.png")).unwrap(), b"img");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp") && n.len() > ".out.jsonl.tmp".len())
            .collect();
        assert!(left.is_empty(), "temporaries left behind: {left:?}");
    }

    #[test]
    fn a_failed_fill_keeps_the_old_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write(&path, b"old").unwrap();
        let err = write_with(&path, |f| {
            f.write_all(b"half")?;
            Err(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "disk full");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_sparse_huge_file_is_refused_from_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let file = File::create(&path).unwrap();
        file.set_len(3 << 30).unwrap();
        let err = read_capped(&path, SIDE_FILE_BYTES).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::FileTooLarge);
        assert!(err.to_string().contains(&(3u64 << 30).to_string()), "{err}");
        std::fs::write(&path, b"{}").unwrap();
        assert_eq!(read_text_capped(&path, SIDE_FILE_BYTES).unwrap(), "{}");
    }

    #[test]
    fn a_written_file_has_the_permissions_of_a_plain_create() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let path = dir.path().join("ours");
        write(&path, b"x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), mode(&plain));
    }
}
