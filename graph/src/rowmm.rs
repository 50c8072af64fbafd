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
    /// Per-channel integer rows (one scale per row).
    pub fn per_channel(q: Vec<i16>, scale: Vec<f32>, inp: usize) -> Rows {
        Rows::ints(q, scale, inp, inp)
    }

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
            Rows::Bf16Mapped { map, start } => hexq_model::weights::to_f32_serial_into(
                &map[start + 2 * src.start..start + 2 * src.end],
                hexq_model::weights::DType::BF16,
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

/// A zeroed vector for a weight's values, its pages first touched by all threads at once: a fresh page costs
/// a fault and a clear (on a VM, ~3 s per GB), and `vec![0; n]` takes them all on one thread while the
/// parallel fill that follows waits.
pub fn zeroed<T: Copy + Default + Send + Sync>(n: usize) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    v.spare_capacity_mut()
        .par_chunks_mut(1 << 16)
        .for_each(|c| c.iter_mut().for_each(|x| _ = x.write(T::default())));
    // SAFETY: every element of 0..n was written above.
    unsafe { v.set_len(n) };
    v
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
        c = s + c;
    }
    let mut g = k4;
    if k - g >= 2 {
        c = (x[g] * w[g] + x[g + 1] * w[g + 1]) + c;
        g += 2;
    }
    if k - g == 1 {
        c = x[g] * w[g] + c;
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

/// Weight rows as the packer reads them: in their stored form, widened in registers (f32 as is, bf16 by a
/// shift, Q16 by `q as f32 · scale[row]` — the same rounded product the scalar widening makes).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Src {
    F32(*const f32),
    Bf16(*const u16),
    /// Integers, their scales from row 0 of the block, groups per row, group shift.
    Q16(*const i16, *const f32, usize, u32),
    /// One-byte integers in panel order ([`Rows::Q8`]) from the block's first panel; scales, groups per
    /// row, group shift.
    Q8(*const i8, *const f32, usize, u32),
}

#[cfg(target_arch = "x86_64")]
impl Src {
    /// 8 values of weight row `row` from column `k`, widened.
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
            Src::Q8(..) => unreachable!("panel-ordered rows are packed by pack_q8"),
        }
    }

    /// One value, widened by the scalar rule.
    #[inline(always)]
    unsafe fn at(self, row: usize, inp: usize, k: usize) -> f32 {
        let at = row * inp + k;
        match self {
            Src::F32(p) => *p.add(at),
            Src::Bf16(p) => f32::from_bits((p.add(at).read_unaligned() as u32) << 16),
            Src::Q16(p, sc, ng, shift) => *p.add(at) as f32 * *sc.add(row * ng + (k >> shift)),
            Src::Q8(..) => unreachable!("panel-ordered rows are packed by pack_q8"),
        }
    }
}

/// Outputs per packed panel (two 8-lane vectors) and inputs per packed chunk (a multiple of 4, so no
/// group of four straddles two chunks; 256 × 16 floats = 16 KB, in L1 while every input row passes).
const NB: usize = 8 * NV;
const NV: usize = 2;
const TILE_ROWS: usize = 3;
const KC: usize = 256;

/// Pack weight rows `j0..j0 + nb` (nb ≤ 16), inputs `k0..k0 + kc`, as `pack[kk][j]` f32 (zeros past nb):
/// the layout the outer-product tile reads — 8×8 blocks transposed in registers, the rest one by one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_panel(
    w: Src,
    inp: usize,
    (j0, nb): (usize, usize),
    (k0, kc): (usize, usize),
    pack: &mut [f32],
) {
    use std::arch::x86_64::*;
    if let Src::Q8(q, sc, ng, shift) = w {
        return pack_q8(q, (sc, ng, shift), inp, (j0, nb), (k0, kc), pack);
    }
    let k8 = kc / 8 * 8;
    for jb in (0..NB).step_by(8) {
        if jb + 8 <= nb {
            for kk in (0..k8).step_by(8) {
                // A plain loop, not `array::from_fn`: the closure was not inlined (a call and an enum
                // dispatch per vector, 10 % of the kernel's time).
                let mut r = [_mm256_setzero_ps(); 8];
                for (i, v) in r.iter_mut().enumerate() {
                    *v = w.load8(j0 + jb + i, inp, k0 + kk);
                }
                let t = transpose8(r);
                for (i, v) in t.iter().enumerate() {
                    _mm256_storeu_ps(pack.as_mut_ptr().add((kk + i) * NB + jb), *v);
                }
            }
            for kk in k8..kc {
                for i in 0..8 {
                    pack[kk * NB + jb + i] = w.at(j0 + jb + i, inp, k0 + kk);
                }
            }
        } else {
            for kk in 0..kc {
                for i in 0..8 {
                    let j = jb + i;
                    pack[kk * NB + j] = if j < nb {
                        w.at(j0 + j, inp, k0 + kk)
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}

/// [`pack_panel`] for panel-ordered one-byte integers: 16 values a load, each times its row's group scale
/// (the scalar widening's one rounded product), scales rebuilt at each group start.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_q8(
    q: *const i8,
    (sc, ng, shift): (*const f32, usize, u32),
    inp: usize,
    (j0, nb): (usize, usize),
    (k0, kc): (usize, usize),
    pack: &mut [f32],
) {
    use std::arch::x86_64::*;
    let base = q.add(j0 * inp); // j0 is a multiple of NB: panel j0 / NB starts here
    let mask = (1usize << shift) - 1;
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for kk in 0..kc {
        let k = k0 + kk;
        if kk == 0 || k & mask == 0 {
            let mut s = [0f32; NB];
            for (i, v) in s.iter_mut().enumerate().take(nb) {
                *v = *sc.add((j0 + i) * ng + (k >> shift));
            }
            s0 = _mm256_loadu_ps(s.as_ptr());
            s1 = _mm256_loadu_ps(s.as_ptr().add(8));
        }
        let v = _mm_loadu_si128(base.add(k * NB) as *const __m128i);
        let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)));
        let o = pack.as_mut_ptr().add(kk * NB);
        _mm256_storeu_ps(o, _mm256_mul_ps(lo, s0));
        _mm256_storeu_ps(o.add(8), _mm256_mul_ps(hi, s1));
    }
}

/// Rows of eight vectors become columns: `out[i][l] = r[l][i]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn transpose8(
    r: [std::arch::x86_64::__m256; 8],
) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// [`dot_m1`]'s schedule over a chunk of `kc` inputs: groups of four (`step(k, first)` for each product, the
/// first starting the group's partial sum), `close` folding each group into the running sum, then a pair and
/// a single for the tail. Both tiles run their lanes through this one schedule.
#[inline(always)]
fn mlas_groups<S>(
    kc: usize,
    st: &mut S,
    step: impl Fn(&mut S, usize, bool),
    close: impl Fn(&mut S),
) {
    let k4 = kc / 4 * 4;
    let mut g = 0;
    while g < k4 {
        step(st, g, true);
        step(st, g + 1, false);
        step(st, g + 2, false);
        step(st, g + 3, false);
        close(st);
        g += 4;
    }
    if kc - g >= 2 {
        step(st, g, true);
        step(st, g + 1, false);
        close(st);
        g += 2;
    }
    if kc - g == 1 {
        step(st, g, true);
        close(st);
    }
}

/// NR input rows × one packed panel of `NB` outputs over one chunk: [`dot_m1`]'s operations with the outputs
/// in lanes (`c` carried between chunks in `acc`, `[rows][NB]`). The panel's two vectors at each `k` are
/// loaded once into registers and used by every row, with a partial sum `s` per row and vector for the
/// group of four: 3 rows × 2 vectors is 6 `c` + 6 `s` + 2 weights + a broadcast — all 16 ymm registers,
/// nothing spilled, 5 loads per 6 multiplies. (Weights as the multiplies' memory operands, 6 rows a tile,
/// was 9 loads per 6 multiplies, at Zen 3's limit of 3 a cycle: 10–25 % slower in `rowmm_bench`.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn panel_tile<const NR: usize>(
    x: &[f32],
    inp: usize,
    r: usize,
    (k0, kc): (usize, usize),
    pack: &[f32],
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    let xp: [*const f32; NR] = std::array::from_fn(|i| x.as_ptr().add((r + i) * inp + k0));
    let ap = acc.as_mut_ptr().add(r * NB);
    let c: [[__m256; NV]; NR] =
        std::array::from_fn(|i| std::array::from_fn(|h| _mm256_loadu_ps(ap.add(i * NB + 8 * h))));
    let pp = pack.as_ptr();
    let s = [[_mm256_setzero_ps(); NV]; NR];
    // Products of step k into s: the first of a group starts s, the rest add to it.
    let step = |s: &mut [[__m256; NV]; NR], k: usize, first: bool| {
        let w: [__m256; NV] = std::array::from_fn(|h| _mm256_loadu_ps(pp.add(k * NB + 8 * h)));
        for i in 0..NR {
            let b = _mm256_broadcast_ss(&*xp[i].add(k));
            for h in 0..NV {
                let p = _mm256_mul_ps(b, w[h]);
                s[i][h] = if first { p } else { _mm256_add_ps(s[i][h], p) };
            }
        }
    };
    let mut st = (s, c);
    mlas_groups(
        kc,
        &mut st,
        |(s, _), k, first| step(s, k, first),
        |(s, c)| {
            for i in 0..NR {
                for h in 0..NV {
                    c[i][h] = _mm256_add_ps(s[i][h], c[i][h]);
                }
            }
        },
    );
    let c = st.1;
    for (i, ci) in c.iter().enumerate() {
        for (h, v) in ci.iter().enumerate() {
            _mm256_storeu_ps(ap.add(i * NB + 8 * h), *v);
        }
    }
}

/// All input rows against weight rows `0..ncol` of `w`: per panel of 16 outputs and chunk of 256 inputs,
/// pack once, then every row through it — `tiles(x, inp, (k0, kc), pack, acc)` runs all rows, on the tile of
/// the target-feature build this is inlined into.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_with(
    (x, rows, inp): (&[f32], usize, usize),
    w: Src,
    ncol: usize,
    out: &mut [f32],
    tiles: impl Fn(&[f32], usize, (usize, usize), &[f32], &mut [f32]),
) {
    let mut pack = vec![0f32; KC * NB];
    let mut acc = vec![0f32; rows * NB];
    for j0 in (0..ncol).step_by(NB) {
        let nb = NB.min(ncol - j0);
        acc.fill(0.0);
        for k0 in (0..inp).step_by(KC) {
            let kc = KC.min(inp - k0);
            pack_panel(w, inp, (j0, nb), (k0, kc), &mut pack);
            tiles(x, inp, (k0, kc), &pack, &mut acc);
        }
        for r in 0..rows {
            out[r * ncol + j0..r * ncol + j0 + nb].copy_from_slice(&acc[r * NB..r * NB + nb]);
        }
    }
}

/// Rows `0..rows` through `$tile::<NR>` NR at a time, the last few through the narrower instance — every
/// remainder below NR listed, so no row is skipped.
macro_rules! tile_rows {
    ($tile:ident, $nr:expr, $rows:expr, ($x:expr, $inp:expr, $kk:expr, $pack:expr, $acc:expr), [$($rem:literal)*]) => {{
        let mut r = 0;
        while r + $nr <= $rows {
            $tile::<{ $nr }>($x, $inp, r, $kk, $pack, $acc);
            r += $nr;
        }
        match $rows - r {
            0 => {}
            $($rem => $tile::<$rem>($x, $inp, r, $kk, $pack, $acc),)*
            n => unreachable!("{n} rows past the tile"),
        }
    }};
}

/// [`block_with`] on the AVX2 tile, 3 rows at a time ([`panel_tile`]; no FMA, so Zen's separate multiply and
/// add pipes both run).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(x: &[f32], rows: usize, inp: usize, w: Src, ncol: usize, out: &mut [f32]) {
    block_with(
        (x, rows, inp),
        w,
        ncol,
        out,
        |x, inp, kk, pack, acc| tile_rows!(panel_tile, TILE_ROWS, rows, (x, inp, kk, pack, acc), [2 1]),
    )
}

/// [`panel_tile`] with the panel's 16 outputs in one zmm register (AVX-512F): the same multiplies and adds
/// per lane in the same order — so the same bits — at twice the width. 6 rows a tile (12 of 32 registers):
/// on a Zen 5 EPYC, `rowmm_bench` at 64 rows gives 300–340 GFLOP/s on two cores against the AVX2 tile's
/// 215–230; 4 to 7 rows are within 5 % of each other, 12 rows (24 registers) drop to ~145 on one core.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn panel_tile512<const NR: usize>(
    x: &[f32],
    inp: usize,
    r: usize,
    (k0, kc): (usize, usize),
    pack: &[f32],
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    let xp: [*const f32; NR] = std::array::from_fn(|i| x.as_ptr().add((r + i) * inp + k0));
    let ap = acc.as_mut_ptr().add(r * NB);
    let c: [__m512; NR] = std::array::from_fn(|i| _mm512_loadu_ps(ap.add(i * NB)));
    let pp = pack.as_ptr();
    let mut st = ([_mm512_setzero_ps(); NR], c);
    let step = |(s, _): &mut ([__m512; NR], [__m512; NR]), k: usize, first: bool| {
        let w = _mm512_loadu_ps(pp.add(k * NB));
        for i in 0..NR {
            let p = _mm512_mul_ps(_mm512_set1_ps(*xp[i].add(k)), w);
            s[i] = if first { p } else { _mm512_add_ps(s[i], p) };
        }
    };
    mlas_groups(kc, &mut st, step, |(s, c)| {
        for i in 0..NR {
            c[i] = _mm512_add_ps(s[i], c[i]);
        }
    });
    let c = st.1;
    for (i, v) in c.iter().enumerate() {
        _mm512_storeu_ps(ap.add(i * NB), *v);
    }
}

/// Input rows per AVX-512 tile (see [`panel_tile512`]).
const TILE_ROWS_512: usize = 6;

/// [`block_with`] on the AVX-512 tile ([`panel_tile512`]), 6 rows at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block_avx512(x: &[f32], rows: usize, inp: usize, w: Src, ncol: usize, out: &mut [f32]) {
    block_with(
        (x, rows, inp),
        w,
        ncol,
        out,
        |x, inp, kk, pack, acc| tile_rows!(panel_tile512, TILE_ROWS_512, rows, (x, inp, kk, pack, acc), [5 4 3 2 1]),
    )
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && avx2()
            && std::env::var_os("HEXQ_NO_AVX512").is_none()
    })
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
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

    /// The AVX2 kernel equals the scalar reference bit for bit, for f32, bf16 and grouped integer rows, with
    /// every tail: rows past the 6-row tile, outputs past a 16-wide panel, inputs past a 256 chunk and past a
    /// group of four (1, 2, 3 left).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_vector_kernel_equals_the_reference() {
        if !avx2() {
            eprintln!("no AVX2 + FMA here: only the scalar order runs");
            return;
        }
        for (rows, out, inp) in [
            (9usize, 7usize, 77usize),
            (25, 19, 300),
            (35, 16, 64),
            (23, 33, 40),
            (13, 11, 96),
            (4, 3, 16),
            (1, 5, 5),
            (17, 4, 2048),
            (5, 37, 517),
            (6, 33, 262),
            (3, 16, 259),
            (2, 18, 1536),
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
                    q: q.clone(),
                    scale: sc.clone(),
                    group,
                },
                Rows::ints(q, sc, group, inp),
            ];
            assert!(
                matches!(forms[4], Rows::Q8 { .. }),
                "values in ±127 are kept in a byte"
            );
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
                    Rows::Q8 { q, scale, group } => {
                        let (ng, shift) = groups(*group, inp);
                        Src::Q8(q.as_ptr(), scale.as_ptr(), ng, shift)
                    }
                };
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let mut got = vec![0f32; rows * out];
                unsafe { block_avx2(&x, rows, inp, src, out, &mut got) };
                assert_eq!(bits(&got), bits(&want), "avx2 {rows}x{out}x{inp}");
                if std::is_x86_feature_detected!("avx512f") {
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
