//! Peak resident memory per stage of a long job (the build's stage table): this process's high-water mark,
//! reset between stages through `/proc/self/clear_refs` (Linux ≥ 4.0), and the peaks child tools report
//! (the QNN compile script reports its own `ru_maxrss`). Best effort: where /proc is missing, `None`.

use std::sync::atomic::{AtomicU64, Ordering};

static CHILD_PEAK_KIB: AtomicU64 = AtomicU64::new(0);

/// Start a new measurement: freed heap handed back to the system (glibc keeps it otherwise, and one stage's
/// freed buffers would count against the next), this process's high-water mark dropped to its current RSS,
/// child peaks forgotten.
pub fn reset() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        // SAFETY: malloc_trim only releases free heap pages; no pointer is touched.
        libc::malloc_trim(0);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    CHILD_PEAK_KIB.store(0, Ordering::Relaxed);
}

/// A child process's peak RSS (KiB), as it reported it.
pub fn note_child(kib: u64) {
    CHILD_PEAK_KIB.fetch_max(kib, Ordering::Relaxed);
}

/// The largest process since [`reset`]: this one's VmHWM or a child's reported peak, in KiB.
pub fn peak_kib() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })?;
    Some(own.max(CHILD_PEAK_KIB.load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_follows_an_allocation_and_a_reported_child() {
        super::reset();
        let before = super::peak_kib().unwrap();
        let v = vec![1u8; 64 << 20];
        std::hint::black_box(&v);
        let after = super::peak_kib().unwrap();
        // Not the full 64 MiB: heap pages freed before the reset (and kept resident by the allocator) can
        // back part of the new vector — measured 61,436 KiB of growth once in CI.
        assert!(after >= before + 48 * 1024, "{before} -> {after}");
        super::note_child(after + 1000);
        assert_eq!(super::peak_kib(), Some(after + 1000));
    }
}
