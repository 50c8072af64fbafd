//! `y = x · Wᵀ` for a checkpoint weight kept as its own `[out, in]` rows — the one kernel every weight MatMul
//! of the interpreter runs, for one token or a batch of many.
//!
//! Why our own: each output `y[r][j]` is one dot product of input row `r` with weight row `j`, summed in
//! onnxruntime's order ([`dot_m1`]) whatever the number of rows — so a batch of prompts gives bit for bit the
//! values one prompt at a time gives (a BLAS picks other kernels for other row counts and the low bits
//! move), calibration's ranges do not depend on the batch size, and a decode step of the exported graph in
//! onnxruntime computes the same sums. A weight panel is read from memory once per batch and reused for every
//! input row: the batch turns the decode step from bandwidth-bound into compute-bound.
//!
//! Weights stay in the checkpoint's dtype: bf16 rows are widened to f32 as they are packed (exact: bf16 → f32
//! only appends zero bits), so a bf16 checkpoint costs half the memory of f32 copies and computes the same
//! numbers.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
use x86::{avx2, avx512, block_avx2, block_avx512, Src};
#[cfg(test)]
mod tests;

pub use crate::zeroed;

/// A weight's rows as stored (reached through [`RowWeight`]'s constructors).
pub(crate) enum Rows {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    /// bf16 rows read in place from the checkpoint's mapping (little-endian bytes `start..start + 2·out·in`,
    /// any alignment): no copy of the weight per backend — at E2B each copy was 3.8 GB of fresh pages.
    Bf16Mapped {
        map: std::sync::Arc<memmap2::Mmap>,
        start: usize,
    },
    /// Fake-quantized rows kept as their integers: value `q as f32 · scale` — bit for bit the f32
    /// quantize→dequantize value (`(q_u − zp)` is an exact integer), in 2 bytes instead of 4. One scale per
    /// `group` inputs of each row (`scale[j · inp/group + k/group]`): `group == inp` is per channel; smaller
    /// groups (a power of two ≥ 16 dividing `inp`: q4_0, LPBQ blocks) keep every 16-lane load in one group.
    Q16 {
        q: Vec<i16>,
        scale: Vec<f32>,
        group: usize,
    },
    /// [`Rows::Q16`] in one byte a value, where every integer fits (symmetric int8 weights, 4-bit grids):
    /// half the memory, half the bytes each packing reads — and stored in the packer's order, panels of
    /// [`NB`] rows interleaved (`q[(j / NB)·NB·inp + k·NB + j % NB]`, rows past `out` zero): a panel is one
    /// sequential stream, widened 16 values a load with no transpose. Row-major rows read 16 strided streams,
    /// and their DRAM stalls and the 8×8 transposes were a quarter of the weight MatMuls' time at E2B.
    Q8 {
        q: Vec<i8>,
        scale: Vec<f32>,
        group: usize,
    },
}

impl Rows {
    /// Integer rows (`[out, inp]` row-major) with one scale per `group` inputs: one byte a value in panel
    /// order when every integer fits in an i8 ([`Rows::Q8`]), else two ([`Rows::Q16`]).
    pub fn ints(q: Vec<i16>, scale: Vec<f32>, group: usize, inp: usize) -> Rows {
        let fits = q
            .par_chunks(1 << 16)
            .all(|c| c.iter().all(|&v| v as i8 as i16 == v));
        if !fits || inp == 0 {
            return Rows::Q16 { q, scale, group };
        }
        let out = q.len() / inp;
        Rows::ints_with(out, inp, scale, group, |j, d, _| {
            d.copy_from_slice(&q[j * inp..(j + 1) * inp])
        })
    }

    /// Integer rows made row by row (`fill(j, row j's integers, scratch)`) straight into their stored form:
    /// [`Rows::Q8`] panels when every integer fits a byte — no two-byte copy of the whole weight first (at
    /// E2B, 3.8 GB of fresh pages to fault in and clear) — else [`Rows::Q16`], made again.
    pub fn ints_with(
        out: usize,
        inp: usize,
        scale: Vec<f32>,
        group: usize,
        fill: impl Fn(usize, &mut [i16], &mut Vec<f32>) + Sync,
    ) -> Rows {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        let fits = AtomicBool::new(inp > 0);
        let mut q8 = zeroed::<i8>(out.div_ceil(NB) * NB * inp);
        q8.par_chunks_mut(NB * inp.max(1))
            .enumerate()
            .for_each_init(
                || (vec![0i16; NB * inp], Vec::new()),
                |(rows, buf), (p, d)| {
                    // The panel's rows first, then written in panel order: one sequential pass over `d`
                    // (16 strided passes, one per row, were a third of the bake's time).
                    let nb = NB.min(out - p * NB);
                    for (i, row) in rows.chunks_mut(inp).take(nb).enumerate() {
                        if !fits.load(Relaxed) {
                            return;
                        }
                        fill(p * NB + i, row, buf);
                        // A fold, not `any`: no early exit, so it vectorizes.
                        if !row.iter().fold(true, |a, &v| a & (v as i8 as i16 == v)) {
                            fits.store(false, Relaxed);
                            return;
                        }
                    }
                    for (k, dk) in d.chunks_exact_mut(NB).enumerate() {
                        for (i, v) in dk.iter_mut().take(nb).enumerate() {
                            *v = rows[i * inp + k] as i8;
                        }
                    }
                },
            );
        if fits.into_inner() {
            return Rows::Q8 {
                q: q8,
                scale,
                group,
            };
        }
        drop(q8);
        let mut q = zeroed::<i16>(out * inp);
        q.par_chunks_mut(inp.max(1))
            .enumerate()
            .for_each_init(Vec::new, |buf, (j, d)| fill(j, d, buf));
        Rows::Q16 { q, scale, group }
    }
}

/// (groups per row, shift taking an input index to its group) of a Q16 weight.
fn groups(group: usize, inp: usize) -> (usize, u32) {
    if group == inp {
        return (1, 31); // k < 2^31: every k in group 0
    }
    assert!(
        group >= LANES && group.is_power_of_two() && inp.is_multiple_of(group),
        "rowmm: group {group} must be a power of two ≥ {LANES} dividing {inp}"
    );
    (inp / group, group.trailing_zeros())
}

/// A MatMul weight as its `[out, in]` rows, in whichever stored form its maker chose: the one type through
/// which every crate hands weights to [`matmul`].
pub struct RowWeight {
    pub out: usize,
    pub inp: usize,
    pub(crate) rows: Rows,
}

/// Constructors: one per stored form, and the queries the bakes need.
impl RowWeight {
    /// f32 rows, `[out, inp]` row-major.
    pub fn f32(out: usize, inp: usize, v: Vec<f32>) -> Self {
        assert_eq!(
            v.len(),
            out * inp,
            "rowmm: {} values are not [{out}, {inp}]",
            v.len()
        );
        RowWeight {
            out,
            inp,
            rows: Rows::F32(v),
        }
    }
    /// bf16 rows (the bit patterns), `[out, inp]` row-major.
    pub fn bf16(out: usize, inp: usize, v: Vec<u16>) -> Self {
        assert_eq!(
            v.len(),
            out * inp,
            "rowmm: {} values are not [{out}, {inp}]",
            v.len()
        );
        RowWeight {
            out,
            inp,
            rows: Rows::Bf16(v),
        }
    }
    /// bf16 rows read in place from a mapping: little-endian bytes `start..start + 2·out·inp`, any alignment.
    pub fn bf16_mapped(
        out: usize,
        inp: usize,
        map: std::sync::Arc<memmap2::Mmap>,
        start: usize,
    ) -> Self {
        assert!(
            start + 2 * out * inp <= map.len(),
            "rowmm: mapped rows past the mapping's end"
        );
        RowWeight {
            out,
            inp,
            rows: Rows::Bf16Mapped { map, start },
        }
    }
    /// Integer rows (`[out, inp]` row-major), value `q · scale[j · inp/group + k/group]`.
    pub fn ints(out: usize, inp: usize, q: Vec<i16>, scale: Vec<f32>, group: usize) -> Self {
        RowWeight {
            out,
            inp,
            rows: Rows::ints(q, scale, group, inp),
        }
    }
    /// Integer rows made row by row straight into their stored form (one byte a value in panel order when every integer fits, else two).
    pub fn ints_with(
        out: usize,
        inp: usize,
        scale: Vec<f32>,
        group: usize,
        fill: impl Fn(usize, &mut [i16], &mut Vec<f32>) + Sync,
    ) -> Self {
        RowWeight {
            out,
            inp,
            rows: Rows::ints_with(out, inp, scale, group, fill),
        }
    }
    /// True when the rows are kept as integers and scales (already on a grid).
    pub fn is_ints(&self) -> bool {
        matches!(self.rows, Rows::Q16 { .. } | Rows::Q8 { .. })
    }
    /// Replace integer rows' scales (one per group of each row); false, unchanged, for float rows.
    pub fn set_scales(&mut self, s: Vec<f32>) -> bool {
        match &mut self.rows {
            Rows::Q16 { scale, .. } | Rows::Q8 { scale, .. } => {
                *scale = s;
                true
            }
            _ => false,
        }
    }
    /// `x · Wᵀ` ([`matmul`]).
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        matmul(x, rows, self)
    }
}

/// Mapped rows drop their pages from this process's resident set when the weight is dropped (a bake that
/// replaced them, a backend freed): they stay in the page cache, and any other view of the same bytes
/// faults them back in on its next read — so peak RSS is what it was when the rows were copies.
impl Drop for RowWeight {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some((map, a, len)) = self.mapped_pages() {
            // SAFETY: a read-only file mapping: DONTNEED discards clean pages only, re-read from the file
            // on the next access (after munlock: locked pages cannot be discarded).
            unsafe {
                libc::munlock(map.as_ptr().add(a) as *const libc::c_void, len);
                let _ = map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, len);
            }
        }
    }
}

impl RowWeight {
    /// Row `j`'s integers times their group scales (the scalar widening rule of both integer forms).
    fn widen_ints<T: Copy + Into<f32>>(
        &self,
        j: usize,
        q: &[T],
        scale: &[f32],
        group: usize,
        buf: &mut Vec<f32>,
    ) {
        let (ng, shift) = groups(group, self.inp);
        let sc = &scale[j * ng..(j + 1) * ng];
        buf.extend(
            q.iter()
                .enumerate()
                .map(|(k, &v)| v.into() * sc[k >> shift]),
        );
    }

    /// Row `j` as f32 values (exact: bf16 widened, integers times their scale), borrowed when stored as f32.
    pub fn row<'a>(&'a self, j: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let src = j * self.inp..(j + 1) * self.inp;
        buf.clear();
        match &self.rows {
            Rows::F32(v) => return &v[src],
            Rows::Bf16(v) => buf.extend(v[src].iter().map(|&b| f32::from_bits((b as u32) << 16))),
            Rows::Bf16Mapped { map, start } => crate::convert::bf16_to_f32_into(
                &map[start + 2 * src.start..start + 2 * src.end],
                buf,
            ),
            Rows::Q16 { q, scale, group } => self.widen_ints(j, &q[src], scale, *group, buf),
            Rows::Q8 { q, scale, group } => {
                let (ng, shift) = groups(*group, self.inp);
                let (base, sc) = ((j / NB) * NB * self.inp + j % NB, &scale[j * ng..]);
                buf.extend((0..self.inp).map(|k| q[base + k * NB] as f32 * sc[k >> shift]));
            }
        }
        buf
    }
}

impl RowWeight {
    /// Keep mapped rows resident (mlock) while the mapping lives: the kernel reads them in place on every
    /// call, and a host that reclaims "cold" page cache turns a call into disk reads — this VM runs DAMON
    /// pageout on file pages seen accessed at most once per 5 s window for a minute, which is what a large
    /// model's weights look like between decode calls seconds apart. Rows in memory need nothing. False when
    /// the lock is refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK): still correct, at the page cache's mercy.
    /// Pin only rows that runs keep using (not ones a bake replaces), or they stay resident for nothing.
    pub fn pin(&self) -> bool {
        match self.mapped_pages() {
            // SAFETY: the range lies inside the live mapping; mlock only changes residency.
            #[cfg(unix)]
            Some((map, a, len)) => unsafe {
                libc::mlock(map.as_ptr().add(a) as *const libc::c_void, len) == 0
            },
            _ => true,
        }
    }

    /// Mapped rows' whole pages: the mapping, the first page's offset, the length.
    fn mapped_pages(&self) -> Option<(&memmap2::Mmap, usize, usize)> {
        let Rows::Bf16Mapped { map, start } = &self.rows else {
            return None;
        };
        let page = 4096usize;
        let a = start / page * page;
        Some((map, a, start + 2 * self.out * self.inp - a))
    }
}

/// Smallest integer group: every 8-lane load of a Q16 row stays in one group.
const LANES: usize = 16;

/// The summation order of every output — onnxruntime's: MLAS's one-row kernel (`SgemmKernelM1Avx`, what
/// its CPU MatMul runs for an `[1, K] × [K, N]` product, i.e. every decode-step MatMul of an exported graph)
/// sums four products at a time, `s = ((p0 + p1) + p2) + p3`, then `c = s + c` (c from +0), a pair then a
/// single product for the `K mod 4` tail; every product and sum rounded on its own, no FMA. Measured bit for
/// bit against onnxruntime 1.32 (`tests/judges/mlas_order.py`). Quantsim computing onnxruntime's sums means
/// the exported QDQ graph reproduces it step for step instead of flipping a quantization step wherever a sum
/// lands near a grid boundary — what aimet-onnx gets by running its QuantSim on onnxruntime itself. The
/// order depends on `k` alone, so a batch of rows computes the same bits as one row at a time.
pub fn dot_m1(x: &[f32], w: &[f32]) -> f32 {
    let k = x.len().min(w.len());
    let k4 = k / 4 * 4;
    let mut c = 0f32;
    for g in (0..k4).step_by(4) {
        let s = x[g] * w[g] + x[g + 1] * w[g + 1];
        let s = s + x[g + 2] * w[g + 2];
        let s = s + x[g + 3] * w[g + 3];
        c += s;
    }
    let mut g = k4;
    if k - g >= 2 {
        c += x[g] * w[g] + x[g + 1] * w[g + 1];
        g += 2;
    }
    if k - g == 1 {
        c += x[g] * w[g];
    }
    c
}

/// `out[r][c] = x[r] · w[c]` for a block of `ncol` weight rows already widened to f32.
fn block_ref(x: &[f32], rows: usize, inp: usize, w: &[f32], ncol: usize, out: &mut [f32]) {
    for c in 0..ncol {
        for r in 0..rows {
            out[r * ncol + c] = dot_m1(&x[r * inp..(r + 1) * inp], &w[c * inp..(c + 1) * inp]);
        }
    }
}

/// Outputs per packed panel (two 8-lane vectors) and inputs per packed chunk (a multiple of 4, so no
/// group of four straddles two chunks; 256 × 16 floats = 16 KB, in L1 while every input row passes).
const NB: usize = 8 * NV;
const NV: usize = 2;
const TILE_ROWS: usize = 3;
const KC: usize = 256;

/// One block of output columns `j0..j0 + ncol`: every input row against those weight rows.
fn run_block(
    x: &[f32],
    rows: usize,
    inp: usize,
    w: &RowWeight,
    j0: usize,
    ncol: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // The block's rows through pointers offset to row j0 (the packer indexes rows from 0).
        let src = match &w.rows {
            Rows::F32(v) => Src::F32(v[j0 * inp..].as_ptr()),
            Rows::Bf16(v) => Src::Bf16(v[j0 * inp..].as_ptr()),
            // Possibly unaligned: read with unaligned loads only.
            Rows::Bf16Mapped { map, start } => {
                Src::Bf16(map[start + 2 * j0 * inp..].as_ptr() as *const u16)
            }
            Rows::Q16 { q, scale, group } => {
                let (ng, shift) = groups(*group, inp);
                Src::Q16(q[j0 * inp..].as_ptr(), scale[j0 * ng..].as_ptr(), ng, shift)
            }
            Rows::Q8 { q, scale, group } => {
                let (ng, shift) = groups(*group, inp);
                Src::Q8(q[j0 * inp..].as_ptr(), scale[j0 * ng..].as_ptr(), ng, shift)
            }
        };
        // SAFETY: avx512()/avx2() checked the CPU's features; the pointers cover rows j0..j0 + ncol.
        if avx512() {
            return unsafe { block_avx512(x, rows, inp, src, ncol, out) };
        }
        return unsafe { block_avx2(x, rows, inp, src, ncol, out) };
    }
    let mut buf = Vec::new();
    let mut wf = Vec::with_capacity(ncol * inp);
    for j in j0..j0 + ncol {
        wf.extend_from_slice(w.row(j, &mut buf));
    }
    block_ref(x, rows, inp, &wf, ncol, out)
}

/// Output columns per parallel task: enough work per task, and blocks that keep x hot in cache.
const COLS: usize = 64;

/// `x` is `[rows, inp]` row-major; returns `[rows, out]`.
pub fn matmul(x: &[f32], rows: usize, w: &RowWeight) -> Vec<f32> {
    let (inp, n) = (w.inp, w.out);
    assert_eq!(x.len(), rows * inp, "rowmm: x is not [rows, {inp}]");
    let nb = n.div_ceil(COLS);
    // Each task writes its own [rows][cols] block; gathered into [rows][out] after.
    let blocks: Vec<Vec<f32>> = (0..nb)
        .into_par_iter()
        .map(|b| {
            let j0 = b * COLS;
            let ncol = COLS.min(n - j0);
            let mut o = vec![0f32; rows * ncol];
            run_block(x, rows, inp, w, j0, ncol, &mut o);
            o
        })
        .collect();
    let mut y = vec![0f32; rows * n];
    for (b, o) in blocks.iter().enumerate() {
        let j0 = b * COLS;
        let ncol = o.len() / rows.max(1);
        for r in 0..rows {
            y[r * n + j0..r * n + j0 + ncol].copy_from_slice(&o[r * ncol..(r + 1) * ncol]);
        }
    }
    y
}
