//! Ctrl-C and job-scheduler timeouts lose nothing but the interrupted output: every live temp path
//! ([`crate::AtomicDir`], [`crate::AtomicFile`]) is registered here, and [`install`] routes SIGINT / SIGTERM /
//! SIGHUP to a thread that removes them and exits 128 + signal (130, 143, 129), as shells report.
//!
//! The handler itself only writes the signal number to a pipe (async-signal-safe); the cleanup runs on an
//! ordinary thread, so it may take locks and touch the filesystem.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static mut PIPE_W: libc::c_int = -1;

pub(crate) fn register(p: &Path) {
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(p.to_path_buf());
}

pub(crate) fn unregister(p: &Path) {
    let mut l = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = l.iter().rposition(|q| q == p) {
        l.swap_remove(i);
    }
}

/// Remove every registered temp output (files and directories).
pub fn cleanup() {
    let l = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    for p in l.iter() {
        let _ = std::fs::remove_dir_all(p).or_else(|_| std::fs::remove_file(p));
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    let b = sig as u8;
    // SAFETY: write(2) is async-signal-safe; PIPE_W is set before the handler is installed.
    unsafe {
        libc::write(PIPE_W, &b as *const u8 as *const libc::c_void, 1);
    }
}

/// Install the handlers (once, at the start of `main`). Children started later get the default dispositions
/// back at exec, as POSIX resets caught signals.
pub fn install() {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: plain libc calls on owned descriptors; PIPE_W is written once, before any handler can run.
    unsafe {
        if libc::pipe(fds.as_mut_ptr()) != 0 {
            return;
        }
        PIPE_W = fds[1];
    }
    let r = fds[0];
    std::thread::spawn(move || {
        let mut b = 0u8;
        // SAFETY: reading one byte into a local from our own pipe.
        let n = unsafe { libc::read(r, &mut b as *mut u8 as *mut libc::c_void, 1) };
        if n == 1 {
            // Writers keep running until exit: one of them may recreate a directory inside the temp tree
            // just removed, so sweep until the registered paths stay gone.
            let mut quiet = 0;
            for _ in 0..50 {
                cleanup();
                std::thread::sleep(std::time::Duration::from_millis(10));
                let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
                quiet = if live.iter().any(|p| p.exists()) {
                    0
                } else {
                    quiet + 1
                };
                if quiet >= 3 {
                    break;
                }
            }
            eprintln!("hexq: interrupted (signal {b}); temporary outputs removed");
            std::process::exit(128 + b as i32);
        }
    });
    // A closed stdout (`hexq graph … | head`) ends the process as it ends `cat`, not with a panic at the
    // next print (Rust ignores SIGPIPE by default); stdout carries reports, printed after artifacts commit.
    // SAFETY: restoring a default disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: installing a handler that only calls write(2).
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}
