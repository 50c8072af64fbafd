//! MatMul of two activations (attention's q·kᵀ and p·v) with every output element summed in an order fixed
//! by the contraction index alone — onnxruntime's ([`crate::rowmm::dot_m1`]): not by the other operand's
//! extent (candle's gemm picks its blocking from the shapes, so a score came out 1 ulp apart at 48 keys and
//! at 4096). With it, a decode step computes the same bits whatever the ring length (trailing never-written
//! slots add exact zeros), which is what lets calibration run short rings for long contexts
//! (hexq-graph's `build::spanning`) and stay byte-identical, and the exported graph's attention in onnxruntime
//! sums what quantsim sums.

/// `out[b·m·n + i·n + j] = a_b[i] · b_b[:, j]` for each batch item `b`, whose `[k, n]` block of `bv` starts at
/// `offs[b]` with strides `(sk, sn)` (one of them 1: a transposed key ring or a value ring); `a` is
/// `[batch, m, k]` row-major. The interpreter's attention MatMuls call this with candle's storage in place.
pub fn matmul_strided(
    av: &[f32],
    bv: &[f32],
    offs: &[usize],
    (m, k, n): (usize, usize, usize),
    (sk, sn): (usize, usize),
    out: &mut [f32],
) {
    assert!(sk == 1 || sn == 1, "dot: b must be contiguous along k or n");
    let shape = Shape { m, k, n, sk, sn };
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just checked.
        unsafe { kernel_avx2(av, bv, offs, shape, out) };
        return;
    }
    kernel(av, bv, offs, shape, out);
}

/// `a [m, k] · b` on plain slices, for judges: `b` as `[k, n]` rows (a value ring), or with `keys` as
/// `[n, k]` rows read transposed (a key ring, q·kᵀ).
pub fn matmul_slices(
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    keys: bool,
) -> Vec<f32> {
    let (sk, sn) = if keys { (1, k) } else { (n, 1) };
    let shape = Shape { m, k, n, sk, sn };
    let mut out = vec![0f32; m * n];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just checked.
        unsafe { kernel_avx2(a, b, &[0], shape, &mut out) };
        return out;
    }
    kernel(a, b, &[0], shape, &mut out);
    out
}

#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    sk: usize,
    sn: usize,
}

impl Shape {
    /// [`stride_k`] for this product. A key ring (b contiguous along k: q·kᵀ) counts as at least as long as
    /// the head: every exported graph's ring is (context ≥ head_dim), and calibration's shorter spanning rings
    /// must sum in the same slices to stay byte-identical.
    fn stride(&self) -> usize {
        match self.sk {
            1 => stride_k(self.k, self.n.max(self.k)),
            _ => stride_k(self.k, self.n),
        }
    }
}

/// [`kernel`] compiled for AVX2 (the same operations, 8 outputs per vector: no FMA contraction in Rust, so
/// the vector code rounds each product and sum as the scalar code does); the key ring's 8×8 blocks
/// transposed in registers.
#[cfg(target_arch = "x86_64")]
unsafe fn kernel_avx2(av: &[f32], bv: &[f32], offs: &[usize], s: Shape, out: &mut [f32]) {
    use rayon::prelude::*;
    // Batch items (one position's query heads against its ring) are independent: a task each, on every
    // thread — one thread ran them all, and attention was a tenth of a batched decode step at E2B.
    out.par_chunks_mut((s.m * s.n).max(1))
        .zip(offs.par_iter())
        .enumerate()
        .for_each_init(Vec::new, |bt, (bi, (y, &o))| {
            // SAFETY: the caller checked the CPU's features.
            unsafe { item_avx2(av, bv, bi, o, s, y, bt) }
        });
}

/// Batch item `bi` (its `b` block at offset `o`) into `y` (`[m, n]`); `bt` scratch for a transposed key ring.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn item_avx2(
    av: &[f32],
    bv: &[f32],
    bi: usize,
    o: usize,
    s: Shape,
    out: &mut [f32],
    bt: &mut Vec<f32>,
) {
    let Shape { m, k, n, sk, sn } = s;
    if sn == 1 {
        for i in 0..m {
            let x = &av[(bi * m + i) * k..(bi * m + i + 1) * k];
            let y = &mut out[i * n..(i + 1) * n];
            running_avx2(m, x, bv, o, sk, n, y, s.stride());
        }
        return;
    }
    // Keys along k: the [n, k] block transposed to [k, n], then the running sums over it.
    // Every element is written below (blocks, then edges): no clearing between items.
    bt.resize(k * n, 0.0);
    let (k8, n8) = (k / 8 * 8, n / 8 * 8);
    for j in (0..n8).step_by(8) {
        for kk in (0..k8).step_by(8) {
            // A plain loop: an `array::from_fn` closure is not inlined into a target_feature fn.
            let mut r = [std::arch::x86_64::_mm256_setzero_ps(); 8];
            for (i, v) in r.iter_mut().enumerate() {
                *v =
                    std::arch::x86_64::_mm256_loadu_ps(bv.as_ptr().add(o + (j + i) * sn + kk * sk));
            }
            for (i, v) in crate::simd::transpose8(r).iter().enumerate() {
                std::arch::x86_64::_mm256_storeu_ps(bt.as_mut_ptr().add((kk + i) * n + j), *v);
            }
        }
    }
    // The edges the 8×8 blocks left: the last n mod 8 keys, and every key's last k mod 8 values.
    for kk in 0..k {
        let js = if kk < k8 { n8..n } else { 0..n };
        for j in js {
            bt[kk * n + j] = bv[o + j * sn + kk * sk];
        }
    }
    for i in 0..m {
        let x = &av[(bi * m + i) * k..(bi * m + i + 1) * k];
        let y = &mut out[i * n..(i + 1) * n];
        running_avx2(m, x, bt, 0, n, n, y, s.stride());
    }
}

/// [`running`] compiled for AVX2: one row (`m == 1`) as it is; the FMA chains (`m > 1`) with a block of
/// outputs' running sums held in registers across each slice (64 outputs = 8 vectors, then 8 at a time, the
/// last n mod 8 by [`running`]), instead of a load and a store of every sum per input: the same fused
/// multiply-adds in the same order, 2–3× faster.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn running_avx2(
    m: usize,
    x: &[f32],
    b: &[f32],
    o: usize,
    sk: usize,
    n: usize,
    y: &mut [f32],
    stride: usize,
) {
    use std::arch::x86_64::*;
    if m == 1 {
        return running(1, x, b, o, sk, n, y, stride);
    }
    let bp = b.as_ptr().add(o);
    #[inline(always)]
    unsafe fn block<const V: usize>(
        x: &[f32],
        bp: *const f32,
        sk: usize,
        j0: usize,
        y: *mut f32,
        stride: usize,
    ) {
        let k = x.len();
        let mut yb = [_mm256_setzero_ps(); V];
        for (bi, k0) in (0..k).step_by(stride).enumerate() {
            let mut acc = [_mm256_setzero_ps(); V];
            for kk in k0..(k0 + stride).min(k) {
                let xv = _mm256_set1_ps(x[kk]);
                let r = bp.add(kk * sk + j0);
                for (v, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r.add(8 * v)), *a);
                }
            }
            for v in 0..V {
                yb[v] = if bi == 0 {
                    acc[v]
                } else {
                    _mm256_add_ps(yb[v], acc[v])
                };
            }
        }
        for (v, t) in yb.iter().enumerate() {
            _mm256_storeu_ps(y.add(j0 + 8 * v), *t);
        }
    }
    let mut j0 = 0;
    while j0 + 64 <= n {
        block::<8>(x, bp, sk, j0, y.as_mut_ptr(), stride);
        j0 += 64;
    }
    while j0 + 8 <= n {
        block::<1>(x, bp, sk, j0, y.as_mut_ptr(), stride);
        j0 += 8;
    }
    if j0 < n {
        running(2, x, b, o + j0, sk, n - j0, &mut y[j0..], stride);
    }
}

#[inline(always)]
fn kernel(av: &[f32], bv: &[f32], offs: &[usize], s: Shape, out: &mut [f32]) {
    let Shape { m, k, n, sk, sn } = s;
    for (bi, &o) in offs.iter().enumerate() {
        for i in 0..m {
            let x = &av[(bi * m + i) * k..(bi * m + i + 1) * k];
            let y = &mut out[(bi * m + i) * n..(bi * m + i + 1) * n];
            if sn == 1 {
                running(m, x, bv, o, sk, n, y, s.stride());
            } else {
                for (j, yj) in y.iter_mut().enumerate() {
                    let row: Vec<f32> = (0..k).map(|kk| bv[o + j * sn + kk * sk]).collect();
                    *yj = dot(m, x, &row, s.stride());
                }
            }
        }
    }
}

/// The order onnxruntime sums an `[m, k] × [k, n]` product of two activations in (MLAS `MlasSgemmOperation`,
/// B not prepacked): one row (`m == 1`) by the one-row kernel ([`crate::rowmm::dot_m1`]); more rows by the
/// FMA kernel — per output a chain of fused multiply-adds from 0 over each slice of `stride_k` inputs, the
/// slices added in order. Attention's MatMuls have `m` = query heads per KV head (× positions): Gemma-3 270M
/// and E2B take the FMA kernel, a model with one query head per KV head the one-row kernel.
fn dot(m: usize, x: &[f32], w: &[f32], sk: usize) -> f32 {
    if m == 1 {
        return crate::rowmm::dot_m1(x, w);
    }
    let mut c = 0f32;
    for (b, (xs, ws)) in x.chunks(sk).zip(w.chunks(sk)).enumerate() {
        let acc = xs.iter().zip(ws).fold(0f32, |a, (p, q)| p.mul_add(*q, a));
        c = if b == 0 { acc } else { c + acc };
    }
    c
}

/// MLAS's K slice for an `[·, k] × [k, n]` product (`MlasSgemmOperation`: 128, halved while it is twice k when
/// n ≥ k — the N slice doubling — or doubled while the N slice can halve and still cover n).
fn stride_k(k: usize, n: usize) -> usize {
    let (mut sn, mut sk) = (128usize, 128usize);
    if n >= k {
        // (MLAS doubles the N slice here too; only the K slice matters to the sums.)
        while sk / 2 >= k {
            sk /= 2;
        }
    } else {
        while sn > 16 && sn / 2 >= n {
            sk *= 2;
            sn /= 2;
        }
    }
    sk
}

/// `y[j] = Σ_k x[k] · b[o + k·sk + j]` for every j at once, in [`dot`]'s order for `m` rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn running(
    m: usize,
    x: &[f32],
    b: &[f32],
    o: usize,
    sk: usize,
    n: usize,
    y: &mut [f32],
    stride: usize,
) {
    if m == 1 {
        return running_m1(x, b, o, sk, n, y);
    }
    let k = x.len();
    let row = |kk: usize| &b[o + kk * sk..o + kk * sk + n];
    let mut acc = vec![0f32; n];
    for (bi, k0) in (0..k).step_by(stride).enumerate() {
        acc.fill(0.0);
        for kk in k0..(k0 + stride).min(k) {
            let (xv, r) = (x[kk], row(kk));
            for j in 0..n {
                acc[j] = xv.mul_add(r[j], acc[j]);
            }
        }
        if bi == 0 {
            y.copy_from_slice(&acc);
        } else {
            for j in 0..n {
                y[j] += acc[j];
            }
        }
    }
}

/// `y[j] = Σ_k x[k] · b[o + k·sk + j]` for every j at once, in [`crate::rowmm::dot_m1`]'s order
/// (onnxruntime's): four products summed, then added to the running value; the pair and single tail.
#[inline(always)]
fn running_m1(x: &[f32], b: &[f32], o: usize, sk: usize, n: usize, y: &mut [f32]) {
    let k = x.len();
    let row = |kk: usize| &b[o + kk * sk..o + kk * sk + n];
    y.fill(0.0);
    let k4 = k / 4 * 4;
    for g in (0..k4).step_by(4) {
        let (x0, x1, x2, x3) = (x[g], x[g + 1], x[g + 2], x[g + 3]);
        let (b0, b1, b2, b3) = (row(g), row(g + 1), row(g + 2), row(g + 3));
        for j in 0..n {
            let s = x0 * b0[j] + x1 * b1[j];
            let s = s + x2 * b2[j];
            let s = s + x3 * b3[j];
            y[j] += s;
        }
    }
    let mut g = k4;
    if k - g >= 2 {
        let (x0, x1, b0, b1) = (x[g], x[g + 1], row(g), row(g + 1));
        for j in 0..n {
            y[j] += x0 * b0[j] + x1 * b1[j];
        }
        g += 2;
    }
    if k - g == 1 {
        let (x0, b0) = (x[g], row(g));
        for j in 0..n {
            y[j] += x0 * b0[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 build equals the scalar kernel bit for bit, both layouts of b, tails included, and each
    /// output is [`dot`] of its row and column (the one-row order for m = 1, the sliced FMA chains above).
    #[test]
    fn avx2_equals_the_reference_order() {
        for (m, k, n) in [
            (1usize, 256usize, 37usize),
            (3, 40, 8),
            (8, 512, 5),
            (2, 7, 4),
            (1, 16, 3),
            (4, 259, 17),
            (8, 300, 75),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.3) * 0.013)
                .collect();
            let b: Vec<f32> = (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.7) * 0.021)
                .collect();
            // b as [n, k] (keys: sk = 1) and the same values as [k, n] (values: sn = 1).
            let bt: Vec<f32> = (0..k * n).map(|i| b[(i % n) * k + i / n]).collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for (bv, sk, sn) in [(&b, 1usize, k), (&bt, n, 1usize)] {
                let s = Shape { m, k, n, sk, sn };
                let want: Vec<f32> = (0..m * n)
                    .map(|i| {
                        dot(
                            m,
                            &x[i / n * k..(i / n + 1) * k],
                            &b[i % n * k..(i % n + 1) * k],
                            s.stride(),
                        )
                    })
                    .collect();
                let mut slow = vec![0f32; m * n];
                kernel(&x, bv, &[0], s, &mut slow);
                assert_eq!(bits(&slow), bits(&want), "scalar m={m} k={k} n={n} sk={sk}");
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    let mut fast = vec![0f32; m * n];
                    unsafe { kernel_avx2(&x, bv, &[0], s, &mut fast) };
                    assert_eq!(bits(&fast), bits(&want), "avx2 m={m} k={k} n={n} sk={sk}");
                }
                // Three batch items (the first block shared by two, as a broadcast KV head is): each item's
                // outputs what it gives alone, whichever thread takes it.
                let (b2, x3): (Vec<f32>, Vec<f32>) = (
                    bv.iter().chain(bv.iter()).map(|v| v * 0.5).collect(),
                    x.iter().chain(&x).chain(&x).map(|v| v + 0.25).collect(),
                );
                let offs = [0, n * k, 0];
                let mut slow = vec![0f32; 3 * m * n];
                kernel(&x3, &b2, &offs, s, &mut slow);
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    let mut fast = vec![0f32; 3 * m * n];
                    unsafe { kernel_avx2(&x3, &b2, &offs, s, &mut fast) };
                    assert_eq!(
                        bits(&fast),
                        bits(&slow),
                        "batched m={m} k={k} n={n} sk={sk}"
                    );
                }
            }
        }
    }
}
