//! The interpreter's op kernels: one ONNX op on candle tensors (f32; ints as i64, bools as u8).

use crate::ir::{DType, Op};
use candle_core::{DType as CD, Device, Tensor};
use hexq_kernels::{logistic, mean_row, softmax_row};

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
        Op::MatMul => match matmul(x[0], x[1]) {
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
    let cd: Vec<usize> = std::iter::repeat_n(1, r - c.rank())
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

/// Attention's activation MatMuls (q·kᵀ, p·v) with every output summed in an order fixed by the contraction
/// index alone ([`hexq_kernels::dot`]): a decode step computes the same bits whatever the ring length, which
/// lets calibration run short rings ([`crate::build::spanning`]) and stay byte-identical.
/// `a @ b` for f32 operands with equal batch dims, `a` any layout, `b` read in place when its last two
/// axes are either contiguous along k (a transposed key ring) or along n (a value ring). None otherwise.
fn matmul(a: &Tensor, b: &Tensor) -> Option<candle_core::Result<Tensor>> {
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
        hexq_kernels::matmul_strided(av, bv, &offs, (m, k, n), (sk, sn), &mut out);
        let mut dims = ad[..ad.len() - 1].to_vec();
        dims.push(n);
        Tensor::from_vec(out, dims, &Device::Cpu)
    });
    Some(r.and_then(|r| r))
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
