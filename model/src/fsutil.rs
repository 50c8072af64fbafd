//! Atomic outputs: every artifact is written under a temporary name beside its destination and renamed into
//! place only when complete, so a failure never leaves a half-written file or directory behind.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// A directory being built at `<dest>.tmp-<pid>`; `commit` renames it to `dest`. Dropped uncommitted, it is removed.
pub struct AtomicDir {
    pub tmp: PathBuf,
    pub dest: PathBuf,
    done: bool,
}

impl AtomicDir {
    /// `force`: replace an existing `dest`; otherwise an existing `dest` is an error.
    pub fn create(dest: &Path, force: bool) -> Result<Self> {
        if dest.exists() && !force {
            return Err(Error::file(
                dest,
                "already exists (pass --force to replace it)",
            ));
        }
        let name = dest
            .file_name()
            .ok_or_else(|| Error::file(dest, "not a directory name"))?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
        let tmp = parent.join(format!(
            ".{}.tmp-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        }
        std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok(AtomicDir {
            tmp,
            dest: dest.to_path_buf(),
            done: false,
        })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.tmp.join(name)
    }

    pub fn commit(mut self) -> Result<PathBuf> {
        if self.dest.exists() {
            std::fs::remove_dir_all(&self.dest).map_err(|e| Error::io(&self.dest, e))?;
        }
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| Error::io(&self.dest, e))?;
        self.done = true;
        Ok(self.dest.clone())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Write a whole file atomically (temp file in the same directory, fsync, rename).
pub fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let parent = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dest.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dest)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(dest, e));
    }
    Ok(())
}

/// SHA256 of a file, streamed.
pub fn sha256_file(p: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(p, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}
