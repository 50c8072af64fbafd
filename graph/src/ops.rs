//! The interpreter's op kernels: one ONNX op on candle tensors (f32; ints as i64, bools as u8).

use crate::ir::{DType, Op};
use candle_core::{DType as CD, Device, Tensor};

fn bshape(t: &Tensor, shape: &[usize]) -> candle_core::Result<Tensor> {
    if t.dims() == shape {
        Ok(t.clone())
    } else {
        t.broadcast_as(shape)?.contiguous()
    }
}

fn i64s(t: &Tensor) -> candle_core::Result<Vec<i64>> {
    t.to_dtype(CD::I64)?.flatten_all()?.to_vec1::<i64>()
}

/// A possibly negative ONNX axis as an index.
fn axis(a: i64, rank: usize) -> usize {
    if a < 0 {
        (a + rank as i64) as usize
    } else {
        a as usize
    }
}

/// One op on candle tensors, with ONNX's semantics (shapes were checked by `infer` when the graph was built).
pub(crate) fn eval(op: &Op, x: &[&Tensor], out: &[usize]) -> candle_core::Result<Tensor> {
    Ok(match op {
        Op::MatMul => match crate::dot::matmul(x[0], x[1]) {
            Some(t) => t?,
            None => x[0].broadcast_matmul(x[1])?,
        },
        Op::Add => x[0].broadcast_add(x[1])?,
        Op::Sub => x[0].broadcast_sub(x[1])?,
        Op::Mul => x[0].broadcast_mul(x[1])?,
        Op::Div => x[0].broadcast_div(x[1])?,
        Op::Pow => pow(x, out)?,
        Op::Sqrt => x[0].sqrt()?,
        Op::Reciprocal => x[0].recip()?,
        Op::Neg => x[0].neg()?,
        Op::Tanh => x[0].tanh()?,
        Op::Sigmoid => {
            let y = with_f32(x[0], logistic)?;
            Tensor::from_vec(y, x[0].dims(), x[0].device())?
        }
        Op::Cos => x[0].cos()?,
        Op::Sin => x[0].sin()?,
        Op::Mod => python_mod(x, out)?,
        Op::ReduceMean { axes, keepdims } => {
            let r = x[0].rank();
            let mut ax: Vec<usize> = axes.iter().map(|&a| axis(a, r)).collect();
            ax.sort();
            let mut t = x[0].clone();
            let n = t.dim(r - 1)?;
            if ax == [r - 1] && t.dtype() == CD::F32 && n % 8 == 0 {
                // The norms' mean of squares over the last axis: onnxruntime's order.
                let v = with_f32(&t, |v| {
                    v.chunks_exact(n.max(1)).map(mean_row).collect::<Vec<f32>>()
                })?;
                let mut dims = t.dims().to_vec();
                dims[r - 1] = 1;
                t = Tensor::from_vec(v, dims, &Device::Cpu)?;
            } else {
                for &a in ax.iter().rev() {
                    t = t.mean_keepdim(a)?;
                }
            }
            if *keepdims {
                t
            } else {
                t.reshape(out)?
            }
        }
        Op::Softmax { axis: a } => {
            let a = axis(*a, x[0].rank());
            if a + 1 == x[0].rank() && x[0].dtype() == CD::F32 {
                return softmax_last(x[0]);
            }
            let m = x[0].max_keepdim(a)?;
            let ex = x[0].broadcast_sub(&m)?.exp()?;
            ex.broadcast_div(&ex.sum_keepdim(a)?)?
        }
        Op::Reshape { .. } | Op::Unsqueeze { .. } => x[0].reshape(out)?,
        Op::Transpose { perm } => x[0].permute(perm.as_slice())?.contiguous()?,
        Op::Concat { axis: a } => Tensor::cat(x, axis(*a, x[0].rank()))?,
        Op::Slice { starts, ends, axes } => slice(x[0], starts, ends, axes)?,
        Op::Gather { axis: a } => gather(x[0], x[1], axis(*a, x[0].rank()), out)?,
        Op::ScatterND => scatter_nd(x[0], x[1], x[2])?,
        Op::Where => {
            if let Some(t) = where_slabs(x[0], x[1], x[2], out) {
                return t;
            }
            let c = bshape(x[0], out)?;
            c.where_cond(&bshape(x[1], out)?, &bshape(x[2], out)?)?
        }
        Op::Equal => x[0].broadcast_eq(x[1])?,
        Op::Less => x[0].broadcast_lt(x[1])?,
        Op::Greater => x[0].broadcast_gt(x[1])?,
        Op::Cast { to } => match to {
            DType::F32 | DType::F16 | DType::BF16 => x[0].to_dtype(CD::F32)?,
            DType::I32 | DType::I64 => x[0].to_dtype(CD::I64)?,
            DType::Bool => x[0].ne(&x[0].zeros_like()?)?,
        },
        Op::Expand { .. } => x[0].broadcast_as(out)?.contiguous()?,
    })
}

/// `Where` whose condition varies along one axis only (the ring write: `entry == slot` over the buffer
/// length) as slab copies: each slab along that axis comes whole from `x` or `y`, an operand of extent 1 on
/// that axis giving the same slab every time. The same values as the general broadcast select, at memcpy
/// speed (the general path indexes every element through broadcast strides). None when the pattern differs.
fn where_slabs(
    c: &Tensor,
    x: &Tensor,
    y: &Tensor,
    out: &[usize],
) -> Option<candle_core::Result<Tensor>> {
    let r = out.len();
    if c.rank() > r
        || x.rank() != r
        || y.rank() != r
        || x.dtype() != CD::F32
        || y.dtype() != CD::F32
    {
        return None;
    }
    let cd: Vec<usize> = std::iter::repeat(1)
        .take(r - c.rank())
        .chain(c.dims().iter().copied())
        .collect();
    let a = cd.iter().position(|&d| d > 1)?;
    if cd[a] != out[a] || cd.iter().enumerate().any(|(k, &d)| k != a && d != 1) {
        return None;
    }
    let fits = |t: &Tensor| {
        t.dims()
            .iter()
            .zip(out)
            .enumerate()
            .all(|(k, (&d, &o))| d == o || (k == a && d == 1))
    };
    if !fits(x) || !fits(y) {
        return None;
    }
    let cond: Vec<u8> = match c
        .flatten_all()
        .and_then(|t| t.to_dtype(CD::U8))
        .and_then(|t| t.to_vec1())
    {
        Ok(v) => v,
        Err(e) => return Some(Err(e)),
    };
    let (n, outer, inner) = (
        out[a],
        out[..a].iter().product::<usize>(),
        out[a + 1..].iter().product::<usize>(),
    );
    let r = with_f32(x, |xv| {
        with_f32(y, |yv| {
            let mut v = Vec::with_capacity(outer * n * inner);
            for o in 0..outer {
                for (i, &ci) in cond.iter().enumerate() {
                    let (src, t) = if ci != 0 { (xv, x) } else { (yv, y) };
                    let at = if t.dim(a).unwrap_or(0) == 1 {
                        o * inner
                    } else {
                        (o * n + i) * inner
                    };
                    v.extend_from_slice(&src[at..at + inner]);
                }
            }
            Tensor::from_vec(v, out, &Device::Cpu)
        })
    });
    Some(r.and_then(|r| r).and_then(|r| r))
}

/// Softmax over the last axis as onnxruntime's CPU EP computes it (MLAS `MlasComputeSoftmax` on an AVX2
/// machine): row maximum; `e = exp(x − max)` by MLAS's polynomial (`MlasComputeSumExpF32KernelFma3`);
/// the row sum in 8 lanes (element i into lane i mod 8, in order) folded `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`;
/// then `e · (1/sum)`. libm's exp and a division put 87 % of attention probabilities 1 ulp off onnxruntime's,
/// and each one near a 16-bit grid boundary flipped a quantization step in the exported graph.
/// Masked entries (x − max ≤ −88.38) give ~6e-39, not 0: a padded ring adds nothing a sum of order 1 can
/// hold, so rows still sum to the same bits whatever the ring length. (AVX-512 onnxruntime builds sum in 16
/// lanes: on such a CPU the sums may differ from its in the last bit.)
fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.dim(x.rank() - 1)?;
    let v = with_f32(x, |v| {
        let mut out = vec![0f32; v.len()];
        for (row, o) in v.chunks_exact(n.max(1)).zip(out.chunks_exact_mut(n.max(1))) {
            softmax_row(row, o);
        }
        out
    })?;
    Tensor::from_vec(v, x.dims(), &Device::Cpu)
}

/// A row's mean as onnxruntime's CPU ReduceMean computes it over the last axis (Eigen's vectorized sum on
/// AVX: 8 lanes, element i into lane i mod 8 in order, folded 4, 2, 1; then ÷ n) for a row whose length
/// is a multiple of 8 — every Gemma width; other lengths take a tail path not reproduced here, and the
/// interpreter sums them in candle's order. A sequential sum put 90 % of RMSNorm means 1 ulp off
/// onnxruntime's — each a possible step flip of the 1/rms tensor in the exported graph. Measured against
/// onnxruntime 1.32 (tests/judges/mlas_order.py).
pub fn mean_row(row: &[f32]) -> f32 {
    debug_assert!(row.len() % 8 == 0);
    let mut lanes = [0f32; 8];
    for (i, &v) in row.iter().enumerate() {
        lanes[i % 8] += v;
    }
    let l = lanes;
    let (a, b, c, d) = (l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]);
    ((a + c) + (b + d)) / row.len() as f32
}

/// One row of [`softmax_last`].
///
/// onnxruntime picks its softmax kernel by the CPU, and so does this: on AVX-512F machines its sum of exps
/// runs in 16 lanes, else in 8 (the same exp either way: the polynomial by FMAs, 2^m built in the float's
/// bits) — so the exported graph's Softmax in onnxruntime on the same machine gives the same bits
/// (tests/judges/mlas_order.py; on a Zen 5 the 8-lane sum put 1695 of 3072 values 1 ulp or more off).
pub fn softmax_row(row: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the features were just checked.
        return unsafe { softmax_row_avx512(row, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just checked.
        return unsafe { softmax_row_fma(row, out) };
    }
    softmax_row_with::<8>(row, out, f32::mul_add)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_row_fma(row: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    softmax_row_with::<8>(row, out, |a, b, c| {
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax_row_avx512(row: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    softmax_row_with::<16>(row, out, |a, b, c| {
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
    })
}

/// MLAS's `MlasExpConstants` (the sum-of-exp kernel's subset): lower clamp, rounding bias 1.5·2²³, 1/ln 2,
/// ln 2 split high/low, the polynomial (poly_5 = poly_6 = 1).
const EXP_LOWER: f32 = -88.3762626647949;
const EXP_BIAS: f32 = 12582912.0;
const EXP_LOG2_RECIP: f32 = 1.44269504088896341;
const EXP_LOG2_HIGH: f32 = -6.93145752e-1;
const EXP_LOG2_LOW: f32 = -1.42860677e-6;
const EXP_POLY: [f32; 6] = [
    f32::from_bits(0x3ab4a000), // 0x1.694000p-10
    f32::from_bits(0x3c092f6e), // 0x1.125edcp-7
    f32::from_bits(0x3d2aadad), // 0x1.555b5ap-5
    f32::from_bits(0x3e2aaa28), // 0x1.555450p-3
    f32::from_bits(0x3efffffb), // 0x1.fffff6p-2
    1.0,
];

/// MLAS's softmax over one row with the sum of exps in `L` lanes (element i into lane i mod L, in order), the
/// lanes folded as its kernels fold them: 16 → 8 by lane l + lane l+8, then ((0+1)+(2+3)) + ((4+5)+(6+7)).
#[inline(always)]
fn softmax_row_with<const L: usize>(
    row: &[f32],
    out: &mut [f32],
    fma: impl Fn(f32, f32, f32) -> f32,
) {
    let max = row.iter().copied().fold(f32::MIN, f32::max);
    let neg = -max;
    let mut lanes = [0f32; L];
    for (i, (&v, o)) in row.iter().zip(out.iter_mut()).enumerate() {
        let x = (v + neg).max(EXP_LOWER);
        let biased = fma(x, EXP_LOG2_RECIP, EXP_BIAS);
        let m = biased - EXP_BIAS;
        let x = fma(m, EXP_LOG2_HIGH, x);
        let x = fma(m, EXP_LOG2_LOW, x);
        let mut p = fma(EXP_POLY[0], x, EXP_POLY[1]);
        for &c in &EXP_POLY[2..] {
            p = fma(p, x, c);
        }
        p = fma(p, x, EXP_POLY[5]);
        let normal = (biased.to_bits() << 23).wrapping_add(0x3F80_0000);
        *o = p * f32::from_bits(normal);
        lanes[i % L] += *o;
    }
    let mut l = [0f32; 8];
    for (j, v) in l.iter_mut().enumerate() {
        *v = if L == 16 {
            lanes[j + 8] + lanes[j]
        } else {
            lanes[j]
        };
    }
    let sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    let scale = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= scale;
    }
}

/// `f` on an f32 tensor's values, read in place when contiguous.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    {
        let (st, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
            (&*st, layout.contiguous_offsets())
        {
            return Ok(f(&v[a..b]));
        }
    }
    let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
    Ok(f(&v))
}

/// MLAS's logistic (onnxruntime's CPU Sigmoid: Eigen's rational approximation, `LogisticKernelFma3` on
/// AVX2 machines): clamp to ±18, p(x)/q(x²) by fused multiply-adds, + 0.5, clamp to [0, 1]. Not correctly
/// rounded (1 ulp off 1/(1+e^-x) on half the inputs, ~1e-8 absolute below −16) — but the exported QDQ graph
/// runs exactly this, so quantsim does too: a sigmoid 1 ulp apart was half of the quantization-step flips
/// between onnxruntime and quantsim on the trained model (README: "The fix: BOS on the host").
pub fn logistic(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just checked.
        unsafe { logistic_fma(x, &mut y) };
        return y;
    }
    for (o, &v) in y.iter_mut().zip(x) {
        *o = logistic1(v, f32::mul_add);
    }
    y
}

/// (α₉, α₇, α₅, α₃, α₁) and (β₁₀, β₈, β₆, β₄, β₂, β₀): MLAS's `MlasLogisticConstants`.
const LOGI_P: [f32; 5] = [
    4.37031012579801e-11,
    1.15627324459942e-07,
    6.08574864600143e-05,
    8.51377133304701e-03,
    2.48287947061529e-01,
];
const LOGI_Q: [f32; 6] = [
    6.10247389755681e-13,
    5.76102136993427e-09,
    6.29106785017040e-06,
    1.70198817374094e-03,
    1.16817656904453e-01,
    9.93151921023180e-01,
];

#[inline(always)]
fn logistic1(x: f32, fma: impl Fn(f32, f32, f32) -> f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let v = x.clamp(-18.0, 18.0);
    let v2 = v * v;
    let mut p = fma(v2, LOGI_P[0], LOGI_P[1]);
    for &a in &LOGI_P[2..] {
        p = fma(p, v2, a);
    }
    p *= v;
    let mut q = fma(v2, LOGI_Q[0], LOGI_Q[1]);
    for &b in &LOGI_Q[2..] {
        q = fma(q, v2, b);
    }
    (p / q + 0.5).clamp(0.0, 1.0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn logistic_fma(x: &[f32], y: &mut [f32]) {
    // The fused multiply-add is the instruction here (f32::mul_add without the target feature is a libm call).
    for (o, &v) in y.iter_mut().zip(x) {
        *o = logistic1(v, |a, b, c| {
            use std::arch::x86_64::*;
            _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
        });
    }
}

fn pow(x: &[&Tensor], out: &[usize]) -> candle_core::Result<Tensor> {
    let a = bshape(x[0], out)?.flatten_all()?.to_vec1::<f32>()?;
    let b = bshape(&x[1].to_dtype(CD::F32)?, out)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let v: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p.powf(*q)).collect();
    Tensor::from_vec(v, out, &Device::Cpu)
}

/// ONNX Mod with fmod = 0: the result takes the divisor's sign (Python's `%`).
fn python_mod(x: &[&Tensor], out: &[usize]) -> candle_core::Result<Tensor> {
    let a = i64s(&bshape(x[0], out)?)?;
    let b = i64s(&bshape(x[1], out)?)?;
    let m = |p: i64, q: i64| p.rem_euclid(q) + if q < 0 && p.rem_euclid(q) != 0 { q } else { 0 };
    let v: Vec<i64> = a.iter().zip(&b).map(|(p, q)| m(*p, *q)).collect();
    Tensor::from_vec(v, out, &Device::Cpu)
}

fn slice(x: &Tensor, starts: &[i64], ends: &[i64], axes: &[i64]) -> candle_core::Result<Tensor> {
    let mut t = x.clone();
    for ((&st, &en), &ax) in starts.iter().zip(ends).zip(axes) {
        let a = axis(ax, t.rank());
        let d = t.dim(a)? as i64;
        let cl = |v: i64| if v < 0 { (v + d).max(0) } else { v.min(d) };
        let (s0, s1) = (cl(st), cl(en));
        t = t.narrow(a, s0 as usize, (s1 - s0).max(0) as usize)?;
    }
    t.contiguous()
}

fn gather(x: &Tensor, idx: &Tensor, a: usize, out: &[usize]) -> candle_core::Result<Tensor> {
    let d = x.dim(a)? as i64;
    let ix: Vec<i64> = i64s(idx)?
        .into_iter()
        .map(|i| if i < 0 { i + d } else { i })
        .collect();
    if let Some(bad) = ix.iter().find(|&&i| i < 0 || i >= d) {
        candle_core::bail!("Gather index {bad} out of range for axis of {d}");
    }
    let it = Tensor::from_vec(ix, idx.elem_count(), &Device::Cpu)?;
    x.index_select(&it, a)?.reshape(out)
}

fn scatter_nd(data: &Tensor, indices: &Tensor, updates: &Tensor) -> candle_core::Result<Tensor> {
    let data = data.contiguous()?;
    let shape = data.dims().to_vec();
    let idx = i64s(indices)?;
    let k = *indices.dims().last().expect("rank >= 1, checked by infer");
    let inner: usize = shape[k..].iter().product();
    let is_f = data.dtype() == CD::F32;
    let mut dv: Vec<f32> = if is_f {
        data.flatten_all()?.to_vec1()?
    } else {
        i64s(&data)?.into_iter().map(|v| v as f32).collect()
    };
    let uv: Vec<f32> = updates.to_dtype(CD::F32)?.flatten_all()?.to_vec1()?;
    let strides: Vec<usize> = (0..k).map(|i| shape[i + 1..].iter().product()).collect();
    for (r, ix) in idx.chunks(k).enumerate() {
        let mut off = 0;
        for (j, &v) in ix.iter().enumerate() {
            let dj = shape[j] as i64;
            let v = if v < 0 { v + dj } else { v };
            if v < 0 || v >= dj {
                candle_core::bail!("ScatterND index {v} out of range for dim {dj}");
            }
            off += v as usize * strides[j];
        }
        dv[off..off + inner].copy_from_slice(&uv[r * inner..(r + 1) * inner]);
    }
    let t = Tensor::from_vec(dv, shape.as_slice(), &Device::Cpu)?;
    if is_f {
        Ok(t)
    } else {
        t.to_dtype(CD::I64)
    }
}

#[cfg(test)]
mod tests {
    /// MLAS's logistic bit for bit: inputs and outputs of onnxruntime 1.32's CPU Sigmoid (clamps at ±18, the
    /// output clamp at 0 and 1, ordinary values), both the FMA build and the scalar fallback.
    #[test]
    fn logistic_equals_onnxruntime() {
        let pairs: [(u32, u32); 24] = [
            (0xc1f00000, 0x00000000),
            (0xc1940000, 0x00000000),
            (0xc18f3333, 0x33000000),
            (0xc114cccd, 0x38bfb000),
            (0xc06ccccd, 0x3cc5a600),
            (0xbf800000, 0x3e89b2b1),
            (0xbdfbe76d, 0x3ef0469c),
            (0xb22bcc77, 0x3f000000),
            (0x00000000, 0x3f000000),
            (0x3649539c, 0x3f00000d),
            (0x3f000000, 0x3f1f597e),
            (0x3f9df3b6, 0x3f4646ce),
            (0x40200000, 0x3f6c948f),
            (0x40833333, 0x3f7bd39a),
            (0x40f8a3d7, 0x3f7fe458),
            (0x41300000, 0x3f7ffee8),
            (0x418c0000, 0x3f800000),
            (0x4191999a, 0x3f800000),
            (0x42200000, 0x3f800000),
            (0x3bc98c5f, 0x3f0064c6),
            (0xc118190b, 0x389c1000),
            (0xc149573d, 0x36680000),
            (0x3f0d64e4, 0x3f2279fc),
            (0xc0c40249, 0x3b0f0100),
        ];
        let x: Vec<f32> = pairs.iter().map(|p| f32::from_bits(p.0)).collect();
        let want: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        let got: Vec<u32> = super::logistic(&x).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want);
        let scalar: Vec<u32> = x
            .iter()
            .map(|&v| super::logistic1(v, f32::mul_add).to_bits())
            .collect();
        assert_eq!(scalar, want);
    }

    use super::*;

    /// The slab-copy Where (ring write, trunk ring select) equals candle's broadcast select.
    #[test]
    fn where_slabs_equals_the_broadcast_select() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let out = [1usize, 2, 5, 3];
        let y = Tensor::arange(0f32, 30., &dev)?.reshape(&out)?;
        let full_x = (Tensor::arange(0f32, 30., &dev)?.reshape(&out)? * -1.0)?;
        let row_x = Tensor::new(&[[[[7f32, 8., 9.]], [[4., 5., 6.]]]], &dev)?;
        let cond = Tensor::new(&[0u8, 0, 1, 0, 1], &dev)?.reshape((1, 1, 5, 1))?;
        for x in [&row_x, &full_x] {
            for (a, b) in [(x, &y), (&y, x)] {
                let fast = where_slabs(&cond, a, b, &out).expect("pattern")?;
                let c = bshape(&cond, &out)?;
                let slow = c.where_cond(&bshape(a, &out)?, &bshape(b, &out)?)?;
                let d = (fast - slow)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                assert_eq!(d, 0.0);
            }
        }
        // A condition varying on two axes is not this pattern.
        let c2 = Tensor::ones((1, 2, 5, 1), CD::U8, &dev)?;
        assert!(where_slabs(&c2, &row_x, &y, &out).is_none());
        Ok(())
    }
}
