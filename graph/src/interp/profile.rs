//! Time per op type, printed at exit when HEXQ_PROFILE is set (where a run's time goes).

use std::collections::HashMap;
use std::sync::Mutex;

/// Time per op type over all runs, printed at exit when HEXQ_PROFILE is set (where a run's time goes).
static PROFILE: Mutex<Option<HashMap<String, (f64, u64)>>> = Mutex::new(None);

pub(super) fn profiling() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("HEXQ_PROFILE").is_some())
}

/// The profile as a table, slowest first.
pub fn profile_report() -> Option<String> {
    let p = PROFILE.lock().unwrap();
    let m = p.as_ref()?;
    let mut v: Vec<_> = m.iter().collect();
    v.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let total: f64 = v.iter().map(|x| x.1 .0).sum();
    let mut s = "| op | seconds | share | calls |\n|---|---|---|---|\n".to_string();
    for (k, (t, n)) in v {
        s += &format!(
            "| {k} | {t:.2} | {:.1} % | {n} |\n",
            100.0 * t / total.max(1e-12)
        );
    }
    Some(s)
}

pub(super) fn record(op: &str, t0: std::time::Instant) {
    let mut p = PROFILE.lock().unwrap();
    let e = p
        .get_or_insert_with(HashMap::new)
        .entry(op.to_string())
        .or_insert((0.0, 0));
    e.0 += t0.elapsed().as_secs_f64();
    e.1 += 1;
}
