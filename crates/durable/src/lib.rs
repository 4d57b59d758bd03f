//! # weir-durable: every file weir writes, written one way
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
