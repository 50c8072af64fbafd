//! Atomic outputs: every artifact is written under a temporary name beside its destination and renamed into
//! place only when complete, so a failure never leaves a half-written file or directory behind; and the
//! SHA256 helpers that manifests and stats use to name their inputs and outputs.
//!
//! May import: std, libc, sha2, rayon — no other hexq crate (every writer of every stage stands on it).

/// What went wrong, and with which file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl Error {
    pub fn file(p: &Path, msg: impl Into<String>) -> Self {
        Error::File {
            path: p.to_path_buf(),
            msg: msg.into(),
        }
    }
    pub fn io(p: &Path, e: std::io::Error) -> Self {
        Error::Io {
            path: p.to_path_buf(),
            source: e,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
use std::path::{Path, PathBuf};

pub mod rss;
pub mod signals;

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
        signals::register(&tmp);
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
        signals::unregister(&self.tmp);
        Ok(self.dest.clone())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.tmp);
            signals::unregister(&self.tmp);
        }
    }
}

/// A file being written at `.<name>.tmp-<pid>` beside `dest`; `commit` renames it to `dest`. Dropped
/// uncommitted (an error, a panic), the temp file is removed.
pub struct AtomicFile {
    pub tmp: PathBuf,
    pub dest: PathBuf,
    done: bool,
}

impl AtomicFile {
    pub fn new(dest: &Path) -> Self {
        let parent = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        signals::register(&tmp);
        AtomicFile {
            tmp,
            dest: dest.to_path_buf(),
            done: false,
        }
    }
    pub fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| Error::io(&self.dest, e))?;
        self.done = true;
        signals::unregister(&self.tmp);
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
            signals::unregister(&self.tmp);
        }
    }
}

/// Write a whole file atomically (temp file in the same directory, fsync, rename).
pub fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let out = AtomicFile::new(dest);
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&out.tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    res.map_err(|e| Error::io(dest, e))?;
    out.commit()
}

/// Every regular file under `dir`, as paths relative to it (sorted).
pub fn list_files(dir: &Path) -> Result<Vec<String>> {
    fn walk(base: &Path, d: &Path, out: &mut Vec<String>) -> Result<()> {
        for e in std::fs::read_dir(d).map_err(|e| Error::io(d, e))? {
            let p = e.map_err(|e| Error::io(d, e))?.path();
            if p.is_dir() {
                walk(base, &p, out)?;
            } else if let Ok(r) = p.strip_prefix(base) {
                out.push(r.to_string_lossy().to_string());
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

/// SHA256 of bytes, as lowercase hex.
pub fn sha256_bytes(b: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("{:x}", Sha256::digest(b))
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

/// `hash` of each file, in parallel (one core would dominate an export's manifest).
pub fn sha256_par(files: &[PathBuf], hash: fn(&Path) -> Result<String>) -> Result<Vec<String>> {
    use rayon::prelude::*;
    files.par_iter().map(|f| hash(f)).collect()
}

/// One SHA256 over several files' (cached) SHA256s: the identity of a checkpoint or a dataset.
pub fn sha256_files(paths: &[&Path]) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in paths {
        h.update(sha256_file_cached(p)?.as_bytes());
    }
    Ok(format!("{:x}", h.finalize()))
}

/// [`sha256_file`] through a stat-keyed cache (git's index idea): a checkpoint's multi-GB files are hashed
/// once, and every later calibrate/export of the same files reuses it. The key is (device, inode, size,
/// mtime, ctime) — any write to the file, or a replacement, changes ctime — stored under
/// `$XDG_CACHE_HOME/hexq/sha256/` (else `~/.cache/…`). The cache is best effort: unreadable or unwritable, the
/// file is hashed. `HEXQ_NO_HASH_CACHE=1` always hashes.
pub fn sha256_file_cached(p: &Path) -> Result<String> {
    match (
        std::env::var_os("HEXQ_NO_HASH_CACHE"),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    ) {
        (Some(_), _, _) => sha256_file(p),
        (None, Some(c), _) => sha256_cached_in(p, &PathBuf::from(c).join("hexq/sha256")),
        (None, None, Some(h)) => sha256_cached_in(p, &PathBuf::from(h).join(".cache/hexq/sha256")),
        _ => sha256_file(p),
    }
}

fn sha256_cached_in(p: &Path, dir: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
    let key = format!(
        "{}:{}:{}:{}.{}:{}.{}",
        m.dev(),
        m.ino(),
        m.len(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    );
    let abs = std::fs::canonicalize(p).map_err(|e| Error::io(p, e))?;
    let entry = dir.join(format!(
        "{:x}",
        Sha256::digest(abs.as_os_str().as_encoded_bytes())
    ));
    if let Ok(t) = std::fs::read_to_string(&entry) {
        if let Some((k, h)) = t.trim().split_once(' ') {
            if k == key && h.len() == 64 {
                return Ok(h.to_string());
            }
        }
    }
    let h = sha256_file(p)?;
    if std::fs::create_dir_all(dir).is_ok() {
        let _ = write_atomic(&entry, format!("{key} {h}\n").as_bytes());
    }
    Ok(h)
}

/// A write-once output file, hashed (SHA256) as it is written, that bypasses the page cache (`O_DIRECT`):
/// exports write gigabytes that nothing reads back soon, and on this class of machine the buffered path —
/// a kernel copy into freshly allocated cache pages, then reclaim of the source's pages — cost more CPU than
/// everything else the exporter does (measured: 20 s of 44 s sys for 12.7 GB). Data goes through three
/// 4 KiB-aligned 8 MiB buffers in a pipeline: the caller fills one while a hasher thread hashes the previous
/// and a writer thread writes the one before (an `O_DIRECT` write returns only when the disk has the data; with
/// hashing and writing on one thread, SHA256 and the disk took turns).
/// The tail is padded to a block and the file truncated to its length. Where the filesystem refuses
/// `O_DIRECT` (tmpfs) — or with `HEXQ_BUFFERED_IO=1` — it is an ordinary file.
pub struct HashedFile {
    path: PathBuf,
    buf: Option<AlignedBuf>,
    fill: usize,
    len: u64,
    /// Full buffers to the hasher (then the writer): (buffer, bytes to write, bytes to hash).
    tx: Option<std::sync::mpsc::SyncSender<(AlignedBuf, usize, usize)>>,
    back: std::sync::mpsc::Receiver<AlignedBuf>,
    hasher: Option<std::thread::JoinHandle<String>>,
    writer: Option<std::thread::JoinHandle<Result<std::fs::File>>>,
    direct: bool,
}

const BLOCK: usize = 4096;
const BUF: usize = 8 << 20;

struct AlignedBuf(*mut u8);
// SAFETY: the buffer is owned uniquely by whoever holds it (producer or writer thread).
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(BUF, BLOCK).unwrap()
    }
    fn new() -> Self {
        // SAFETY: non-zero size; null is handled.
        let p = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        if p.is_null() {
            std::alloc::handle_alloc_error(Self::layout());
        }
        AlignedBuf(p)
    }
    fn slice(&mut self) -> &mut [u8] {
        // SAFETY: BUF bytes allocated in `new`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.0, BUF) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.0, Self::layout()) }
    }
}

impl HashedFile {
    pub fn create(p: &Path) -> Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let open = |flags: i32| {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(flags)
                .open(p)
        };
        let want = std::env::var_os("HEXQ_BUFFERED_IO").is_none();
        let (f, direct) = match want.then(|| open(libc::O_DIRECT)) {
            Some(Ok(f)) => (f, true),
            Some(Err(e)) if e.raw_os_error() != Some(libc::EINVAL) => return Err(Error::io(p, e)),
            _ => (open(0).map_err(|e| Error::io(p, e))?, false),
        };
        let (tx, rx) = std::sync::mpsc::sync_channel::<(AlignedBuf, usize, usize)>(1);
        let (wtx, wrx) = std::sync::mpsc::sync_channel::<(AlignedBuf, usize)>(1);
        let (back_tx, back) = std::sync::mpsc::channel();
        for _ in 0..2 {
            back_tx.send(AlignedBuf::new()).unwrap();
        }
        let path = p.to_path_buf();
        let wpath = path.clone();
        let hasher = std::thread::spawn(move || -> String {
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            for (mut b, n, logical) in rx {
                h.update(&b.slice()[..logical]);
                if wtx.send((b, n)).is_err() {
                    break; // the writer failed; its error is reported
                }
            }
            format!("{:x}", h.finalize())
        });
        let writer = std::thread::spawn(move || -> Result<std::fs::File> {
            use std::os::unix::fs::FileExt;
            let mut at = 0u64;
            for (mut b, n) in wrx {
                f.write_all_at(&b.slice()[..n], at)
                    .map_err(|e| Error::io(&wpath, e))?;
                at += n as u64;
                let _ = back_tx.send(b);
            }
            Ok(f)
        });
        Ok(HashedFile {
            path,
            buf: Some(AlignedBuf::new()),
            fill: 0,
            len: 0,
            tx: Some(tx),
            back,
            hasher: Some(hasher),
            writer: Some(writer),
            direct,
        })
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn put(&mut self, mut b: &[u8]) -> Result<()> {
        self.len += b.len() as u64;
        while !b.is_empty() {
            let n = (BUF - self.fill).min(b.len());
            let fill = self.fill;
            self.buf.as_mut().unwrap().slice()[fill..fill + n].copy_from_slice(&b[..n]);
            self.fill += n;
            b = &b[n..];
            if self.fill == BUF {
                self.send(BUF, BUF)?;
            }
        }
        Ok(())
    }

    /// Hand the current buffer down the pipeline and take a free one back.
    fn send(&mut self, n: usize, logical: usize) -> Result<()> {
        let b = self.buf.take().unwrap();
        let sent = self.tx.as_ref().unwrap().send((b, n, logical)).is_ok();
        match (sent, self.back.recv()) {
            (true, Ok(b)) => {
                self.buf = Some(b);
                self.fill = 0;
                Ok(())
            }
            // The writer stopped: its error says why.
            _ => Err(self
                .join()
                .err()
                .unwrap_or_else(|| Error::file(&self.path, "writer stopped"))),
        }
    }

    fn join(&mut self) -> Result<(std::fs::File, String)> {
        self.tx = None;
        let failed = || Error::file(&self.path, "writer thread failed");
        let h = self.hasher.take().map(|h| h.join());
        let f = match self.writer.take().map(|w| w.join()) {
            Some(Ok(r)) => r?,
            _ => return Err(failed()),
        };
        match h {
            Some(Ok(h)) => Ok((f, h)),
            _ => Err(failed()),
        }
    }

    /// Write the tail, fix the length, sync. Returns (bytes, SHA256 hex).
    pub fn finish(mut self) -> Result<(u64, String)> {
        if self.fill > 0 {
            let n = if self.direct {
                self.fill.div_ceil(BLOCK) * BLOCK
            } else {
                self.fill
            };
            let fill = self.fill;
            self.buf.as_mut().unwrap().slice()[fill..n].fill(0);
            self.send(n, fill)?;
        }
        let (f, sha) = self.join()?;
        if self.direct {
            f.set_len(self.len).map_err(|e| Error::io(&self.path, e))?;
        }
        f.sync_all().map_err(|e| Error::io(&self.path, e))?;
        Ok((self.len, sha))
    }
}

impl Drop for HashedFile {
    fn drop(&mut self) {
        // Unfinished (an error upstream): stop the threads; the caller removes the file.
        self.tx = None;
        if let Some(h) = self.hasher.take() {
            let _ = h.join();
        }
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl std::io::Write for HashedFile {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.put(b).map_err(std::io::Error::other)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Refuse a write of `bytes` into the filesystem holding `dest` (or its nearest existing ancestor) when it
/// has less free space (with 1 % + 64 MiB headroom): fail in a second, naming the file, instead of filling
/// the disk for minutes first.
pub fn ensure_space(dest: &Path, bytes: u64) -> Result<()> {
    let mut probe = dest.to_path_buf();
    while !probe.exists() {
        match probe.parent() {
            Some(p) if !p.as_os_str().is_empty() => probe = p.to_path_buf(),
            _ => {
                probe = PathBuf::from(".");
                break;
            }
        }
    }
    let Some(free) = free_bytes(&probe) else {
        return Ok(()); // unknown (statvfs failed): let the write report its own error
    };
    let need = bytes + bytes / 100 + (64 << 20);
    if free < need {
        return Err(Error::file(
            dest,
            format!(
                "needs {:.2} GiB, {:.2} GiB free on its filesystem",
                need as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            ),
        ));
    }
    Ok(())
}

/// Free bytes for an unprivileged writer on the filesystem holding `p`.
pub fn free_bytes(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and an owned, zeroed statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    Some(s.f_bavail as u64 * s.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_cache_hits_and_notices_changes() {
        let t = tempfile::tempdir().unwrap();
        let (f, cache) = (t.path().join("w.bin"), t.path().join("cache"));
        std::fs::write(&f, b"abcd").unwrap();
        let h1 = sha256_cached_in(&f, &cache).unwrap();
        assert_eq!(h1, sha256_file(&f).unwrap());
        assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
        // A hit returns the stored hash (proved by planting a different one under the same key).
        let e = std::fs::read_dir(&cache)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let key = std::fs::read_to_string(&e)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_string();
        std::fs::write(&e, format!("{key} {}\n", "0".repeat(64))).unwrap();
        assert_eq!(sha256_cached_in(&f, &cache).unwrap(), "0".repeat(64));
        // Same size, new content: ctime moves, the key misses, the file is hashed again.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&f, b"abce").unwrap();
        let h2 = sha256_cached_in(&f, &cache).unwrap();
        assert_eq!(h2, sha256_file(&f).unwrap());
        assert_ne!(h2, h1);
    }

    #[test]
    fn hashed_file_writes_exact_bytes_and_hash() {
        use sha2::Digest;
        let t = tempfile::tempdir().unwrap();
        // Lengths around the block and buffer sizes; pieces of uneven size.
        for len in [
            0usize,
            1,
            4095,
            4096,
            4097,
            BUF - 1,
            BUF,
            BUF + 5,
            3 * BUF + 12345,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
            let p = t.path().join(format!("f{len}"));
            let mut f = HashedFile::create(&p).unwrap();
            for c in data.chunks(1_000_003) {
                f.put(c).unwrap();
            }
            let (n, sha) = f.finish().unwrap();
            assert_eq!(n, len as u64);
            assert_eq!(std::fs::read(&p).unwrap(), data, "len {len}");
            assert_eq!(sha, format!("{:x}", sha2::Sha256::digest(&data)));
        }
    }
}

/// A directory as an artifact names it: its last component (where it lives is the user's business; its
/// content is named by hashes beside it).
pub fn dir_name(p: &Path) -> String {
    p.components()
        .next_back()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Large files of one job with the same bytes as a file met before become hard links to it: a build's four
/// copies of a 5 GB host model (each export directory stays self-contained) take the disk once. Files under
/// 1 MiB, and files a link cannot be made for (another file system), are left alone. Returns the bytes saved.
/// Safe because every hexq writer replaces a file by rename, never rewrites one in place.
pub fn link_identical(
    files: &[PathBuf],
    seen: &mut std::collections::HashMap<(u64, String), PathBuf>,
) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut saved = 0;
    for f in files {
        let m = std::fs::metadata(f).map_err(|e| Error::io(f, e))?;
        if m.len() < 1 << 20 {
            continue;
        }
        let key = (m.len(), sha256_file_cached(f)?);
        match seen.get(&key) {
            None => {
                seen.insert(key, f.clone());
            }
            Some(first) => {
                let fm = std::fs::metadata(first).map_err(|e| Error::io(first, e))?;
                if (fm.dev(), fm.ino()) == (m.dev(), m.ino()) {
                    continue;
                }
                let tmp = f.with_extension(format!("link-{}", std::process::id()));
                let _ = std::fs::remove_file(&tmp);
                if std::fs::hard_link(first, &tmp).is_ok() {
                    std::fs::rename(&tmp, f).map_err(|e| Error::io(f, e))?;
                    saved += m.len();
                }
            }
        }
    }
    Ok(saved)
}

#[cfg(test)]
mod portable_tests {
    #[test]
    fn identical_large_files_become_one_inode() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().unwrap();
        let d = t.path();
        let big = vec![7u8; 2 << 20];
        let mut other = big.clone();
        other[5] = 8;
        let names = ["a", "b", "c", "small1", "small2"];
        let bodies: [&[u8]; 5] = [&big, &big, &other, b"x", b"x"];
        for (n, b) in names.iter().zip(bodies) {
            std::fs::write(d.join(n), b).unwrap();
        }
        let files: Vec<_> = names.iter().map(|n| d.join(n)).collect();
        let mut seen = Default::default();
        assert_eq!(super::link_identical(&files, &mut seen).unwrap(), 2 << 20);
        let ino = |n: &str| std::fs::metadata(d.join(n)).unwrap().ino();
        assert_eq!(ino("a"), ino("b"));
        assert_ne!(ino("a"), ino("c"));
        assert_ne!(ino("small1"), ino("small2"));
        assert_eq!(std::fs::read(d.join("b")).unwrap(), big);
        // A second pass finds nothing left to link.
        assert_eq!(super::link_identical(&files, &mut seen).unwrap(), 0);
    }

    #[test]
    fn a_directory_is_named_by_its_last_component() {
        assert_eq!(
            super::dir_name(std::path::Path::new("/home/u/.cache/hexq/tiny-1/")),
            "tiny-1"
        );
    }
}
