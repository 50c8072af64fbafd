//! `y = x · Wᵀ` for a checkpoint weight kept as its own `[out, in]` rows — the one kernel every weight MatMul
//! of the interpreter runs, for one token or a batch of many.
//!
//! Why our own: each output `y[r][j]` is one dot product of input row `r` with weight row `j`, summed in a
//! fixed order (16 lanes, then a fixed tree) that does not depend on how many rows are in the batch — so a
//! batch of prompts gives bit for bit the values one prompt at a time gives (a BLAS picks other kernels for
//! other row counts and the low bits move), and calibration's ranges do not depend on the batch size. A weight
//! row is read from memory once per batch and reused for every input row: the batch turns the decode step
//! from bandwidth-bound into compute-bound.
//!
//! Weights stay in the checkpoint's dtype: bf16 rows are widened to f32 as they are used (exact: bf16 → f32
//! only appends zero bits), so a bf16 checkpoint costs half the memory of f32 copies and computes the same
//! numbers.

use rayon::prelude::*;

/// A weight's rows as stored.
pub enum Rows {
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
}

impl Rows {
    /// Per-channel integer rows (one scale per row).
    pub fn per_channel(q: Vec<i16>, scale: Vec<f32>, inp: usize) -> Rows {
        Rows::Q16 {
            q,
            scale,
            group: inp,
        }
    }
}

/// (groups per row, shift taking an input index to its group) of a Q16 weight.
fn groups(group: usize, inp: usize) -> (usize, u32) {
    if group == inp {
        return (1, 31); // k < 2^31: every k in group 0
    }
    assert!(
        group >= LANES && group.is_power_of_two() && inp % group == 0,
        "rowmm: group {group} must be a power of two ≥ {LANES} dividing {inp}"
    );
    (inp / group, group.trailing_zeros())
}

pub struct RowWeight {
    pub out: usize,
    pub inp: usize,
    pub rows: Rows,
}

/// Mapped rows drop their pages from this process's resident set when the weight is dropped (a bake that
/// replaced them, a backend freed): they stay in the page cache, and any other view of the same bytes
/// faults them back in on its next read — so peak RSS is what it was when the rows were copies.
impl Drop for RowWeight {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Rows::Bf16Mapped { map, start } = &self.rows {
            let page = 4096usize;
            let a = start / page * page;
            let len = start + 2 * self.out * self.inp - a;
            // SAFETY: a read-only file mapping: DONTNEED discards clean pages only, re-read from the file
            // on the next access.
            unsafe {
                let _ = map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, len);
            }
        }
    }
}

impl RowWeight {
    /// Row `j` as f32 values (exact: bf16 widened, integers times their scale), borrowed when stored as f32.
    pub fn row<'a>(&'a self, j: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let src = j * self.inp..(j + 1) * self.inp;
        buf.clear();
        match &self.rows {
            Rows::F32(v) => return &v[src],
            Rows::Bf16(v) => buf.extend(v[src].iter().map(|&b| f32::from_bits((b as u32) << 16))),
            Rows::Bf16Mapped { map, start } => buf.extend(
                map[start + 2 * src.start..start + 2 * src.end]
                    .chunks_exact(2)
                    .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
            ),
            Rows::Q16 { q, scale, group } => {
                let (ng, shift) = groups(*group, self.inp);
                let sc = &scale[j * ng..(j + 1) * ng];
                buf.extend(
                    q[src]
                        .iter()
                        .enumerate()
                        .map(|(k, &v)| v as f32 * sc[k >> shift]),
                );
            }
        }
        buf
    }
}

const LANES: usize = 16;

/// The reference of the summation order every variant follows: per lane `l`, `acc[l] = fma(x[k], w[k],
/// acc[l])` over `k = l, l + 16, …` (the tail padded with zeros), then the fixed tree 8, 4, 2, 1.
/// `f32::mul_add` is a correctly rounded FMA with or without FMA hardware, so this equals the AVX-512 path bit
/// for bit.
fn dot_ref(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (k, (a, b)) in x.iter().zip(w).enumerate() {
        acc[k % LANES] = a.mul_add(*b, acc[k % LANES]);
    }
    // Padded lanes: fma(0, 0, acc) = acc + 0, which turns a -0 into +0 as the vector path does.
    for l in x.len() % LANES..if x.len() % LANES == 0 { 0 } else { LANES } {
        acc[l] = 0f32.mul_add(0.0, acc[l]);
    }
    reduce(acc)
}

#[inline(always)]
fn reduce(mut acc: [f32; LANES]) -> f32 {
    let mut s = LANES;
    while s > 1 {
        s /= 2;
        for l in 0..s {
            acc[l] += acc[l + s];
        }
    }
    acc[0]
}

/// `out[r][c] = x[r] · w[c]` for a block of `ncol` weight rows already widened to f32.
fn block_ref(x: &[f32], rows: usize, inp: usize, w: &[f32], ncol: usize, out: &mut [f32]) {
    for c in 0..ncol {
        for r in 0..rows {
            out[r * ncol + c] = dot_ref(&x[r * inp..(r + 1) * inp], &w[c * inp..(c + 1) * inp]);
        }
    }
}

/// Weight rows as the AVX-512 tiles read them: in their stored form, widened in registers (f32 as is, bf16 by
/// a shift, Q16 by `q as f32 · scale[row]` — the same rounded product the scalar widening makes), so a block
/// of weights is read from memory once, never copied to an f32 scratch.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Src {
    F32(*const f32),
    Bf16(*const u16),
    /// Integers, their scales from row 0 of the block, groups per row, group shift.
    Q16(*const i16, *const f32, usize, u32),
}

#[cfg(target_arch = "x86_64")]
impl Src {
    /// 16 values of weight row `row` from column `k` (lanes outside `m` are 0).
    #[inline(always)]
    unsafe fn load(self, row: usize, inp: usize, k: usize, m: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let at = row * inp + k;
        match self {
            Src::F32(p) => _mm512_maskz_loadu_ps(m, p.add(at)),
            Src::Bf16(p) => {
                let h = _mm256_maskz_loadu_epi16(m, p.add(at) as *const i16);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            Src::Q16(p, sc, ng, shift) => {
                let h = _mm256_maskz_loadu_epi16(m, p.add(at));
                let v = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(h));
                _mm512_mul_ps(v, _mm512_set1_ps(*sc.add(row * ng + (k >> shift))))
            }
        }
    }
}

/// The same sums with AVX-512: tiles of NR input rows × NC weight rows (4 × 4: 8 loads feed 16 FMAs, all
/// accumulators in registers), each output in its own accumulator, so the tiling changes no value.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn tile<const NR: usize, const NC: usize>(
    x: &[f32],
    w: Src,
    inp: usize,
    (r, c): (usize, usize),
    ncol: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let full = inp / LANES;
    let tail = inp % LANES;
    let mut acc = [[_mm512_setzero_ps(); NC]; NR];
    let xp: [*const f32; NR] = std::array::from_fn(|i| x.as_ptr().add((r + i) * inp));
    for ch in 0..full {
        let wv: [__m512; NC] = std::array::from_fn(|j| w.load(c + j, inp, ch * LANES, 0xffff));
        for i in 0..NR {
            let xv = _mm512_loadu_ps(xp[i].add(ch * LANES));
            for j in 0..NC {
                acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
    }
    if tail > 0 {
        let m: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
        let wv: [__m512; NC] = std::array::from_fn(|j| w.load(c + j, inp, full * LANES, m));
        for i in 0..NR {
            let xv = _mm512_maskz_loadu_ps(m, xp[i].add(full * LANES));
            for j in 0..NC {
                acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
    }
    for i in 0..NR {
        for j in 0..NC {
            out[(r + i) * ncol + c + j] = reduce512(acc[i][j]);
        }
    }
}

/// [`reduce`]'s tree in registers: 8 (upper 256 bits onto lower), 4, 2, 1 — the same additions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn reduce512(v: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn block_avx512(x: &[f32], rows: usize, inp: usize, w: Src, ncol: usize, out: &mut [f32]) {
    // Short rows: 8 × 3 tiles (each widened weight vector feeds 8 FMAs). Long rows: 6 × 4, whose six rows
    // of x stay nearer the core (8 rows of 6144 floats spill the caches: measured 142 vs 154 GFLOP/s).
    if inp <= 2048 {
        block_tiles::<8, 3>(x, rows, inp, w, ncol, out)
    } else {
        block_tiles::<6, 4>(x, rows, inp, w, ncol, out)
    }
}

/// Row groups of MR (more input rows per widened weight vector), then 4, then 1; weight rows NC at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn block_tiles<const MR: usize, const NC: usize>(
    x: &[f32],
    rows: usize,
    inp: usize,
    w: Src,
    ncol: usize,
    out: &mut [f32],
) {
    let mut r = 0;
    while r < rows {
        let left = rows - r;
        let nr = if left >= MR {
            MR
        } else if left >= 4 {
            4
        } else {
            1
        };
        let cn = ncol / NC * NC;
        for c in (0..cn).step_by(NC) {
            match nr {
                4 => tile::<4, NC>(x, w, inp, (r, c), ncol, out),
                1 => tile::<1, NC>(x, w, inp, (r, c), ncol, out),
                _ => tile::<MR, NC>(x, w, inp, (r, c), ncol, out),
            }
        }
        for c in cn..ncol {
            match nr {
                4 => tile::<4, 1>(x, w, inp, (r, c), ncol, out),
                1 => tile::<1, 1>(x, w, inp, (r, c), ncol, out),
                _ => tile::<MR, 1>(x, w, inp, (r, c), ncol, out),
            }
        }
        r += nr;
    }
}

/// 8 values of weight row `row` from column `k` (AVX2: a 16-lane chunk is two halves of 8), widened as
/// [`Src::load`] widens them — the same per-lane values.
#[cfg(target_arch = "x86_64")]
impl Src {
    #[inline(always)]
    unsafe fn load8(self, row: usize, inp: usize, k: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let at = row * inp + k;
        match self {
            Src::F32(p) => _mm256_loadu_ps(p.add(at)),
            Src::Bf16(p) => {
                let h = _mm_loadu_si128(p.add(at) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            Src::Q16(p, sc, ng, shift) => {
                let h = _mm_loadu_si128(p.add(at) as *const __m128i);
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(h));
                _mm256_mul_ps(v, _mm256_set1_ps(*sc.add(row * ng + (k >> shift))))
            }
        }
    }

    /// Row `row`'s values `k..k + n` widened by the scalar rule, zero-padded to 16 (a tail chunk).
    #[inline(always)]
    unsafe fn tail16(self, row: usize, inp: usize, k: usize, n: usize) -> [f32; LANES] {
        let mut t = [0f32; LANES];
        for (l, v) in t.iter_mut().enumerate().take(n) {
            let at = row * inp + k + l;
            *v = match self {
                Src::F32(p) => *p.add(at),
                Src::Bf16(p) => f32::from_bits((p.add(at).read_unaligned() as u32) << 16),
                Src::Q16(p, sc, ng, shift) => {
                    *p.add(at) as f32 * *sc.add(row * ng + ((k + l) >> shift))
                }
            };
        }
        t
    }
}

/// [`tile`] for AVX2 + FMA (no AVX-512: AMD Zen 2/3, most laptops). Lane `l`'s sum only ever meets lane
/// `l`, so the 16 lanes run as two 8-lane halves (lanes 0–7 and 8–15) with the same FMAs in the same
/// order; the tree's first step (lane l + lane l+8) joins the halves, then 4, 2, 1 as [`reduce512`].
/// NR × NC = 3 × 2: 12 accumulators (both halves) + 2 weight vectors + x in the 16 ymm registers
/// (measured on Zen 3: 75–126 GFLOP/s at E2B's shapes, vs 70–89 for 4 × 3 one half at a time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const NR: usize, const NC: usize>(
    x: &[f32],
    w: Src,
    inp: usize,
    (r, c): (usize, usize),
    ncol: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let full = inp / LANES;
    let tail = inp % LANES;
    let xp: [*const f32; NR] = std::array::from_fn(|i| x.as_ptr().add((r + i) * inp));
    // The tail chunk zero-padded (fma(0, 0, acc) in the padded lanes, as the masked AVX-512 loads give).
    let (xt, wt): ([[f32; LANES]; NR], [[f32; LANES]; NC]) = if tail > 0 {
        (
            std::array::from_fn(|i| {
                let mut t = [0f32; LANES];
                t[..tail].copy_from_slice(&x[(r + i) * inp + full * LANES..(r + i + 1) * inp]);
                t
            }),
            std::array::from_fn(|j| w.tail16(c + j, inp, full * LANES, tail)),
        )
    } else {
        ([[0.0; LANES]; NR], [[0.0; LANES]; NC])
    };
    // Both halves in one pass over the rows (each cache line of x and w used whole while it is in L1).
    let mut acc = [[[_mm256_setzero_ps(); NC]; NR]; 2];
    for ch in 0..full {
        for (h, acc) in acc.iter_mut().enumerate() {
            let k = ch * LANES + h * 8;
            let wv: [__m256; NC] = std::array::from_fn(|j| w.load8(c + j, inp, k));
            for i in 0..NR {
                let xv = _mm256_loadu_ps(xp[i].add(k));
                for j in 0..NC {
                    acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
                }
            }
        }
    }
    if tail > 0 {
        for (h, acc) in acc.iter_mut().enumerate() {
            for i in 0..NR {
                let xv = _mm256_loadu_ps(xt[i].as_ptr().add(h * 8));
                for j in 0..NC {
                    let wv = _mm256_loadu_ps(wt[j].as_ptr().add(h * 8));
                    acc[i][j] = _mm256_fmadd_ps(xv, wv, acc[i][j]);
                }
            }
        }
    }
    for i in 0..NR {
        for j in 0..NC {
            out[(r + i) * ncol + c + j] = reduce256(_mm256_add_ps(acc[0][i][j], acc[1][i][j]));
        }
    }
}

/// [`reduce`]'s tree after its first step: 4 (upper 128 bits onto lower), 2, 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn reduce256(s8: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
}

/// Row groups of 3, then the 2 or 1 left; weight rows 2 at a time, then 1 ([`block_tiles`] for AVX2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(x: &[f32], rows: usize, inp: usize, w: Src, ncol: usize, out: &mut [f32]) {
    const NC: usize = 2;
    let mut r = 0;
    while r < rows {
        let nr = (rows - r).min(3);
        let cn = ncol / NC * NC;
        for c in (0..cn).step_by(NC) {
            match nr {
                3 => tile_avx2::<3, NC>(x, w, inp, (r, c), ncol, out),
                2 => tile_avx2::<2, NC>(x, w, inp, (r, c), ncol, out),
                _ => tile_avx2::<1, NC>(x, w, inp, (r, c), ncol, out),
            }
        }
        for c in cn..ncol {
            match nr {
                3 => tile_avx2::<3, 1>(x, w, inp, (r, c), ncol, out),
                2 => tile_avx2::<2, 1>(x, w, inp, (r, c), ncol, out),
                _ => tile_avx2::<1, 1>(x, w, inp, (r, c), ncol, out),
            }
        }
        r += nr;
    }
}

/// The widest kernel this CPU runs (checked once).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Simd {
    Avx512,
    Avx2Fma,
    None,
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn simd() -> Simd {
    static ON: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        if avx512() {
            Simd::Avx512
        } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            Simd::Avx2Fma
        } else {
            Simd::None
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
    })
}

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
    if simd() != Simd::None {
        // The block's rows through pointers offset to row j0 (tiles index rows from 0).
        let src = match &w.rows {
            Rows::F32(v) => Src::F32(v[j0 * inp..].as_ptr()),
            Rows::Bf16(v) => Src::Bf16(v[j0 * inp..].as_ptr()),
            // Possibly unaligned: the tiles read it with unaligned loads only.
            Rows::Bf16Mapped { map, start } => {
                Src::Bf16(map[start + 2 * j0 * inp..].as_ptr() as *const u16)
            }
            Rows::Q16 { q, scale, group } => {
                let (ng, shift) = groups(*group, inp);
                Src::Q16(q[j0 * inp..].as_ptr(), scale[j0 * ng..].as_ptr(), ng, shift)
            }
        };
        // SAFETY: simd() checked the CPU's features; the pointers cover rows j0..j0 + ncol.
        return unsafe {
            match simd() {
                Simd::Avx512 => block_avx512(x, rows, inp, src, ncol, out),
                _ => block_avx2(x, rows, inp, src, ncol, out),
            }
        };
    }
    let wf: std::borrow::Cow<[f32]> = match &w.rows {
        Rows::F32(v) => std::borrow::Cow::Borrowed(&v[j0 * inp..(j0 + ncol) * inp]),
        Rows::Bf16(v) => std::borrow::Cow::Owned(
            v[j0 * inp..(j0 + ncol) * inp]
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect(),
        ),
        Rows::Bf16Mapped { .. } => {
            let mut buf = Vec::new();
            let mut wf = Vec::with_capacity(ncol * inp);
            for j in j0..j0 + ncol {
                wf.extend_from_slice(w.row(j, &mut buf));
            }
            std::borrow::Cow::Owned(wf)
        }
        Rows::Q16 { q, scale, group } => {
            let (ng, shift) = groups(*group, inp);
            let mut w = vec![0f32; ncol * inp];
            for (c, dst) in w.chunks_exact_mut(inp).enumerate() {
                let src = &q[(j0 + c) * inp..(j0 + c + 1) * inp];
                let sc = &scale[(j0 + c) * ng..(j0 + c + 1) * ng];
                for (k, (d, &v)) in dst.iter_mut().zip(src).enumerate() {
                    *d = v as f32 * sc[k >> shift];
                }
            }
            std::borrow::Cow::Owned(w)
        }
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `RowWeight::row` gives each stored form's f32 values: bf16 widened, grouped integers × their scale.
    #[test]
    fn row_widens_each_form() {
        let q: Vec<i16> = (0..64).map(|k| k as i16 - 32).collect();
        let scale = vec![0.5f32, 0.25];
        let w = RowWeight {
            out: 1,
            inp: 64,
            rows: Rows::Q16 {
                q,
                scale,
                group: 32,
            },
        };
        let mut buf = Vec::new();
        let r = w.row(0, &mut buf);
        assert_eq!((r[0], r[31], r[32], r[63]), (-16.0, -0.5, 0.0, 7.75));
        let b = RowWeight {
            out: 2,
            inp: 1,
            rows: Rows::Bf16(vec![0x3f80, 0xc000]),
        };
        assert_eq!(b.row(1, &mut buf), &[-2.0]);
    }

    fn lcg(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// Each vector kernel this CPU has (AVX-512, AVX2 + FMA) equals the scalar reference bit for bit, for
    /// f32, bf16 and grouped integer rows, with tails, every row-tile and column-tile remainder.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_vector_kernel_equals_the_reference() {
        let have512 = avx512();
        let have2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        for (rows, out, inp) in [
            (9usize, 7usize, 77usize),
            (13, 11, 96),
            (4, 3, 16),
            (1, 5, 5),
            (17, 4, 2048),
        ] {
            let x = lcg(rows * inp, 5);
            let wf = lcg(out * inp, 6);
            let bf: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let q: Vec<i16> = (0..out * inp)
                .map(|i| (i as i64 * 7919 % 255 - 127) as i16)
                .collect();
            let group = if inp % 16 == 0 { 16 } else { inp };
            let sc: Vec<f32> = (0..out * inp / group)
                .map(|b| 1e-3 * (b % 13 + 1) as f32)
                .collect();
            // The bf16 rows also from a mapping, one byte off alignment (a safetensors offset may be odd).
            let mut m = memmap2::MmapMut::map_anon(1 + 2 * bf.len()).unwrap();
            for (i, b) in bf.iter().enumerate() {
                m[1 + 2 * i..3 + 2 * i].copy_from_slice(&b.to_le_bytes());
            }
            let map = std::sync::Arc::new(m.make_read_only().unwrap());
            let forms = [
                Rows::F32(wf.clone()),
                Rows::Bf16(bf),
                Rows::Bf16Mapped { map, start: 1 },
                Rows::Q16 {
                    q,
                    scale: sc,
                    group,
                },
            ];
            for rows_form in forms {
                let w = RowWeight {
                    out,
                    inp,
                    rows: rows_form,
                };
                let mut buf = Vec::new();
                let widened: Vec<f32> =
                    (0..out).flat_map(|j| w.row(j, &mut buf).to_vec()).collect();
                let mut want = vec![0f32; rows * out];
                block_ref(&x, rows, inp, &widened, out, &mut want);
                let src = match &w.rows {
                    Rows::F32(v) => Src::F32(v.as_ptr()),
                    Rows::Bf16(v) => Src::Bf16(v.as_ptr()),
                    Rows::Bf16Mapped { map, start } => {
                        Src::Bf16(map[*start..].as_ptr() as *const u16)
                    }
                    Rows::Q16 { q, scale, group } => {
                        let (ng, shift) = groups(*group, inp);
                        Src::Q16(q.as_ptr(), scale.as_ptr(), ng, shift)
                    }
                };
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                if have2 {
                    let mut got = vec![0f32; rows * out];
                    unsafe { block_avx2(&x, rows, inp, src, out, &mut got) };
                    assert_eq!(bits(&got), bits(&want), "avx2 {rows}x{out}x{inp}");
                }
                if have512 {
                    let mut got = vec![0f32; rows * out];
                    unsafe { block_avx512(&x, rows, inp, src, out, &mut got) };
                    assert_eq!(bits(&got), bits(&want), "avx512 {rows}x{out}x{inp}");
                }
            }
        }
    }

    /// One row at a time equals the batch, bit for bit; bf16 rows equal their f32 widening; close to f64.
    #[test]
    fn batch_invariant_and_exact_for_bf16() {
        let (out, inp, rows) = (150, 77, 9);
        let wf = lcg(out * inp, 1);
        let bf: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let widened: Vec<f32> = bf
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        let x = lcg(rows * inp, 2);
        let w16 = RowWeight {
            out,
            inp,
            rows: Rows::Bf16(bf),
        };
        let w32 = RowWeight {
            out,
            inp,
            rows: Rows::F32(widened.clone()),
        };
        let batch = matmul(&x, rows, &w16);
        // Integer rows: q·scale_j widened exactly as f32 rows holding those values.
        let q: Vec<i16> = (0..out * inp)
            .map(|i| (i as i64 * 7919 % 255 - 127) as i16)
            .collect();
        let sc: Vec<f32> = (0..out).map(|j| 0.001 * (j + 1) as f32).collect();
        let qf: Vec<f32> = (0..out * inp).map(|i| q[i] as f32 * sc[i / inp]).collect();
        let wq = RowWeight {
            out,
            inp,
            rows: Rows::per_channel(q.clone(), sc, inp),
        };
        let wqf = RowWeight {
            out,
            inp,
            rows: Rows::F32(qf),
        };
        assert_eq!(matmul(&x, rows, &wq), matmul(&x, rows, &wqf));
        // Group scales (16 and 32 inputs per scale): the same as f32 rows holding q · scale[group].
        for g in [16usize, 32] {
            let inp = 96;
            let q: Vec<i16> = (0..out * inp)
                .map(|i| (i as i64 * 31 % 15 - 7) as i16)
                .collect();
            let sc: Vec<f32> = (0..out * inp / g)
                .map(|b| 1e-3 * (b % 13 + 1) as f32)
                .collect();
            let qf: Vec<f32> = (0..out * inp).map(|i| q[i] as f32 * sc[i / g]).collect();
            let x = lcg(rows * inp, 3);
            let wg = RowWeight {
                out,
                inp,
                rows: Rows::Q16 {
                    q,
                    scale: sc,
                    group: g,
                },
            };
            let wf = RowWeight {
                out,
                inp,
                rows: Rows::F32(qf),
            };
            assert_eq!(matmul(&x, rows, &wg), matmul(&x, rows, &wf), "group {g}");
        }
        let mut reference = vec![0f32; rows * out];
        block_ref(&x, rows, inp, &widened, out, &mut reference);
        assert!(
            reference
                .iter()
                .zip(&batch)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "vector path != reference order"
        );
        assert_eq!(batch, matmul(&x, rows, &w32));
        for r in 0..rows {
            let one = matmul(&x[r * inp..(r + 1) * inp], 1, &w16);
            assert!(one
                .iter()
                .zip(&batch[r * out..(r + 1) * out])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            for j in 0..out {
                let e: f64 = (0..inp)
                    .map(|k| x[r * inp + k] as f64 * widened[j * inp + k] as f64)
                    .sum();
                assert!((one[j] as f64 - e).abs() < 1e-5, "{} vs {e}", one[j]);
            }
        }
    }
}
