//! The weight MatMul's AVX2 and AVX-512 builds: weight panels packed (widened from their stored form in
//! registers), then an outer-product tile runs [`super::dot_m1`]'s multiplies and adds with the outputs in
//! lanes — the same operations in the same order, so the same bits as the reference.

use super::{KC, NB, NV, TILE_ROWS};
use crate::simd::transpose8;

/// Weight rows as the packer reads them: in their stored form, widened in registers (f32 as is, bf16 by a
/// shift, Q16 by `q as f32 · scale[row]` — the same rounded product the scalar widening makes).
#[derive(Clone, Copy)]
pub(super) enum Src {
    F32(*const f32),
    Bf16(*const u16),
    /// Integers, their scales from row 0 of the block, groups per row, group shift.
    Q16(*const i16, *const f32, usize, u32),
    /// One-byte integers in panel order ([`Rows::Q8`]) from the block's first panel; scales, groups per
    /// row, group shift.
    Q8(*const i8, *const f32, usize, u32),
}

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

/// Pack weight rows `j0..j0 + nb` (nb ≤ 16), inputs `k0..k0 + kc`, as `pack[kk][j]` f32 (zeros past nb):
/// the layout the outer-product tile reads — 8×8 blocks transposed in registers, the rest one by one.
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
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block_avx2(
    x: &[f32],
    rows: usize,
    inp: usize,
    w: Src,
    ncol: usize,
    out: &mut [f32],
) {
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
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn block_avx512(
    x: &[f32],
    rows: usize,
    inp: usize,
    w: Src,
    ncol: usize,
    out: &mut [f32],
) {
    block_with(
        (x, rows, inp),
        w,
        ncol,
        out,
        |x, inp, kk, pack, acc| tile_rows!(panel_tile512, TILE_ROWS_512, rows, (x, inp, kk, pack, acc), [5 4 3 2 1]),
    )
}

pub(super) fn avx512() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && avx2()
            && std::env::var_os("HEXQ_NO_AVX512").is_none()
    })
}

pub(super) fn avx2() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    })
}
