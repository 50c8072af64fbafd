//! MatMul of two activations (attention's q·kᵀ and p·v) with every output element summed in an order fixed
//! by the contraction index alone: not by the other operand's extent (candle's gemm picks its blocking from
//! the shapes, so a score came out 1 ulp apart at 48 keys and at 4096). With it, a decode step computes the
//! same bits whatever the ring length (trailing never-written slots add exact zeros), which is what lets
//! calibration run short rings for long contexts ([`crate::build::spanning`]) and stay byte-identical.

use crate::ops::with_f32;
use candle_core::{DType as CD, Device, Tensor};

const LANES: usize = 16;

/// `a @ b` for f32 operands with equal batch dims, `a` any layout, `b` read in place when its last two
/// axes are either contiguous along k (a transposed key ring) or along n (a value ring). None otherwise.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Option<candle_core::Result<Tensor>> {
    let (ad, bd) = (a.dims(), b.dims());
    let r = ad.len();
    if r < 2 || bd.len() != r || ad[..r - 2] != bd[..r - 2] || ad[r - 1] != bd[r - 2] {
        return None;
    }
    if a.dtype() != CD::F32 || b.dtype() != CD::F32 {
        return None;
    }
    let (m, k, n) = (ad[r - 2], ad[r - 1], bd[r - 1]);
    let batch: usize = ad[..r - 2].iter().product();
    let (st, layout) = b.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(bv)) = &*st else {
        return None;
    };
    let bs = layout.stride();
    let (sk, sn) = (bs[r - 2], bs[r - 1]);
    if sk != 1 && sn != 1 {
        return None;
    }
    // Offset of each batch's [k, n] block (any strides on the batch axes).
    let offs: Vec<usize> = (0..batch)
        .map(|mut i| {
            let mut o = layout.start_offset();
            for ax in (0..r - 2).rev() {
                o += (i % bd[ax]) * bs[ax];
                i /= bd[ax];
            }
            o
        })
        .collect();
    let r = with_f32(a, |av| {
        let mut out = vec![0f32; batch * m * n];
        let shape = Shape { m, k, n, sk, sn };
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            unsafe { kernel_avx512(av, bv, &offs, shape, &mut out) };
        } else if std::is_x86_feature_detected!("avx2") {
            unsafe { kernel_avx2(av, bv, &offs, shape, &mut out) };
        } else {
            kernel(av, bv, &offs, shape, &mut out);
        }
        #[cfg(not(target_arch = "x86_64"))]
        kernel(av, bv, &offs, shape, &mut out);
        let mut dims = ad[..ad.len() - 1].to_vec();
        dims.push(n);
        Tensor::from_vec(out, dims, &Device::Cpu)
    });
    Some(r.and_then(|r| r))
}

#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    sk: usize,
    sn: usize,
}

/// [`kernel`] compiled for AVX-512 (the same operations in the same order, wider registers); q·k dots four
/// keys at a time ([`dots4`]) so four independent sums are in flight instead of one add chain.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel_avx512(av: &[f32], bv: &[f32], offs: &[usize], s: Shape, out: &mut [f32]) {
    let Shape { m, k, n, sk, sn } = s;
    if sk != 1 {
        return kernel(av, bv, offs, s, out);
    }
    for (bi, &o) in offs.iter().enumerate() {
        for i in 0..m {
            let x = &av[(bi * m + i) * k..(bi * m + i + 1) * k];
            let y = &mut out[(bi * m + i) * n..(bi * m + i + 1) * n];
            let n4 = n / 4 * 4;
            for j in (0..n4).step_by(4) {
                let ys = dots4(x, bv, o + j * sn, sn);
                y[j..j + 4].copy_from_slice(&ys);
            }
            for (j, yj) in y.iter_mut().enumerate().skip(n4) {
                *yj = dot(x, &bv[o + j * sn..o + j * sn + k]);
            }
        }
    }
}

/// [`kernel`] compiled for AVX2 (the same operations: no FMA contraction, 16 lanes as two 8-wide vectors).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn kernel_avx2(av: &[f32], bv: &[f32], offs: &[usize], s: Shape, out: &mut [f32]) {
    kernel(av, bv, offs, s, out)
}

/// [`dot`] of `x` with the four rows of `b` starting at `at`, `at + sn`, …: per row the same lane sums
/// (a product rounded, then added; the tail added only in its lanes) and the same fold.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots4(x: &[f32], b: &[f32], at: usize, sn: usize) -> [f32; 4] {
    use std::arch::x86_64::*;
    let k = x.len();
    assert!(at + 3 * sn + k <= b.len());
    let (xp, bp) = (x.as_ptr(), b.as_ptr().add(at));
    let mut acc = [_mm512_setzero_ps(); 4];
    let full = k / LANES * LANES;
    for c in (0..full).step_by(LANES) {
        let xv = _mm512_loadu_ps(xp.add(c));
        for (r, a) in acc.iter_mut().enumerate() {
            let p = _mm512_mul_ps(xv, _mm512_loadu_ps(bp.add(r * sn + c)));
            *a = _mm512_add_ps(*a, p);
        }
    }
    if full < k {
        let m: __mmask16 = ((1u32 << (k - full)) - 1) as __mmask16;
        let xv = _mm512_maskz_loadu_ps(m, xp.add(full));
        for (r, a) in acc.iter_mut().enumerate() {
            let p = _mm512_mul_ps(xv, _mm512_maskz_loadu_ps(m, bp.add(r * sn + full)));
            *a = _mm512_mask_add_ps(*a, m, *a, p);
        }
    }
    acc.map(|a| crate::rowmm::reduce512(a))
}

#[inline(always)]
fn kernel(av: &[f32], bv: &[f32], offs: &[usize], s: Shape, out: &mut [f32]) {
    let Shape { m, k, n, sk, sn } = s;
    for (bi, &o) in offs.iter().enumerate() {
        for i in 0..m {
            let x = &av[(bi * m + i) * k..(bi * m + i + 1) * k];
            let y = &mut out[(bi * m + i) * n..(bi * m + i + 1) * n];
            if sk == 1 {
                for (j, yj) in y.iter_mut().enumerate() {
                    *yj = dot(x, &bv[o + j * sn..o + j * sn + k]);
                }
            } else {
                // Row by row of b, k ascending: each element a plain running sum.
                for (kk, &s) in x.iter().enumerate() {
                    let row = &bv[o + kk * sk..o + kk * sk + n];
                    for (yj, &bj) in y.iter_mut().zip(row) {
                        *yj += s * bj;
                    }
                }
            }
        }
    }
}

/// Σ x·y in `LANES` running sums (lane = index mod LANES), then a fixed pairwise fold.
#[inline(always)]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (cx, cy) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    let (rx, ry) = (cx.remainder(), cy.remainder());
    for (p, q) in cx.zip(cy) {
        for l in 0..LANES {
            acc[l] += p[l] * q[l];
        }
    }
    for (l, (p, q)) in rx.iter().zip(ry).enumerate() {
        acc[l] += p * q;
    }
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The four-key AVX-512 path and the AVX2 build equal the scalar reference bit for bit, tails included.
    #[test]
    fn four_key_dots_equal_the_reference() {
        #[cfg(target_arch = "x86_64")]
        {
            for (k, n) in [(256usize, 37usize), (40, 8), (512, 5), (7, 4), (16, 3)] {
                let x: Vec<f32> = (0..k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.3) * 0.013)
                    .collect();
                let b: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 53 % 97) as f32 - 48.7) * 0.021)
                    .collect();
                let s = Shape {
                    m: 1,
                    k,
                    n,
                    sk: 1,
                    sn: k,
                };
                let want: Vec<f32> = (0..n).map(|j| dot(&x, &b[j * k..(j + 1) * k])).collect();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let mut fast = vec![0f32; n];
                if std::is_x86_feature_detected!("avx512f") {
                    unsafe { kernel_avx512(&x, &b, &[0], s, &mut fast) };
                    assert_eq!(bits(&fast), bits(&want), "avx512 k={k} n={n}");
                }
                if std::is_x86_feature_detected!("avx2") {
                    unsafe { kernel_avx2(&x, &b, &[0], s, &mut fast) };
                    assert_eq!(bits(&fast), bits(&want), "avx2 k={k} n={n}");
                }
            }
        }
    }

    /// Equal to candle's matmul within float rounding, for both layouts of b; and a score computed against
    /// more keys (a longer ring, trailing zeros) is the same bits.
    #[test]
    fn fixed_order_matmul_matches_and_ignores_the_ring_length() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (1, 2, 4, 40), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (1, 2, 24, 40), &dev)?;
        let kt = k.transpose(2, 3)?;
        let s = matmul(&q, &kt).unwrap()?;
        let want = q.matmul(&kt.contiguous()?)?;
        let d = (&s - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-4, "{d}");
        let p = Tensor::randn(0f32, 1.0, (1, 2, 4, 24), &dev)?;
        let pv = matmul(&p, &k).unwrap()?;
        let d = (&pv - p.matmul(&k)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(d < 1e-4, "{d}");
        // A ring of 64 slots whose last 40 were never written.
        let long = Tensor::cat(&[&k, &Tensor::zeros((1, 2, 40, 40), CD::F32, &dev)?], 2)?;
        let sl = matmul(&q, &long.transpose(2, 3)?).unwrap()?;
        assert_eq!(
            sl.narrow(3, 0, 24)?.flatten_all()?.to_vec1::<f32>()?,
            s.flatten_all()?.to_vec1::<f32>()?
        );
        let pl = Tensor::cat(&[&p, &Tensor::zeros((1, 2, 4, 40), CD::F32, &dev)?], 3)?;
        let pvl = matmul(&pl, &long).unwrap()?;
        assert_eq!(
            pvl.flatten_all()?.to_vec1::<f32>()?,
            pv.flatten_all()?.to_vec1::<f32>()?
        );
        Ok(())
    }
}
