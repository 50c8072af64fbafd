//! Shape and dtype inference: each op's output type from its inputs' (ONNX's rules), with a typed error.

use crate::ir::{broadcast, norm_axis, DType, Op, TensorType};

/// Output type of `op` for the given input types (shape inference), or why not.
pub fn infer(op: &Op, ins: &[&TensorType]) -> Result<TensorType, InferError> {
    let need = |want: usize| match ins.len() == want {
        true => Ok(()),
        false => Err(InferError::Arity {
            op: op.onnx_name(),
            want,
            got: ins.len(),
        }),
    };
    match op {
        Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Pow | Op::Mod => {
            need(2)?;
            if *op != Op::Pow {
                same_dtype(ins[0], ins[1])?;
            }
            Ok(TensorType::new(
                ins[0].dtype,
                &bcast(&ins[0].shape, &ins[1].shape)?,
            ))
        }
        Op::Equal | Op::Less | Op::Greater => {
            need(2)?;
            same_dtype(ins[0], ins[1])?;
            Ok(TensorType::new(
                DType::Bool,
                &bcast(&ins[0].shape, &ins[1].shape)?,
            ))
        }
        Op::Sqrt | Op::Reciprocal | Op::Neg | Op::Tanh | Op::Sigmoid | Op::Cos | Op::Sin => {
            need(1)?;
            Ok(ins[0].clone())
        }
        Op::Cast { to } => {
            need(1)?;
            Ok(TensorType::new(*to, &ins[0].shape))
        }
        Op::MatMul => need(2).and_then(|_| matmul(ins[0], ins[1])),
        Op::ReduceMean { axes, keepdims } => {
            need(1).and_then(|_| reduce_mean(ins[0], axes, *keepdims))
        }
        Op::Softmax { axis } => {
            need(1)?;
            axis_of(*axis, ins[0].shape.len())?;
            Ok(ins[0].clone())
        }
        Op::Reshape { shape } => need(1).and_then(|_| reshape(ins[0], shape)),
        Op::Transpose { perm } => need(1).and_then(|_| transpose(ins[0], perm)),
        Op::Concat { axis } => concat(ins, *axis),
        Op::Slice { starts, ends, axes } => need(1).and_then(|_| slice(ins[0], starts, ends, axes)),
        Op::Gather { axis } => need(2).and_then(|_| gather(ins[0], ins[1], *axis)),
        Op::ScatterND => need(3).and_then(|_| scatter_nd(ins[0], ins[1], ins[2])),
        Op::Where => {
            need(3)?;
            if ins[0].dtype != DType::Bool {
                return Err(InferError::Invalid("Where condition must be bool".into()));
            }
            same_dtype(ins[1], ins[2])?;
            let s = bcast(&bcast(&ins[0].shape, &ins[1].shape)?, &ins[2].shape)?;
            Ok(TensorType::new(ins[1].dtype, &s))
        }
        Op::Expand { shape } => {
            need(1)?;
            let tgt: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            Ok(TensorType::new(ins[0].dtype, &bcast(&ins[0].shape, &tgt)?))
        }
        Op::Unsqueeze { axes } => need(1).and_then(|_| unsqueeze(ins[0], axes)),
    }
}

/// Why shape inference refused a node (the validator adds the graph and node).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InferError {
    #[error("{op} takes {want} inputs, got {got}")]
    Arity {
        op: &'static str,
        want: usize,
        got: usize,
    },
    #[error("dtype mismatch {0:?} vs {1:?}")]
    DType(DType, DType),
    #[error("shapes {0:?} and {1:?} do not broadcast")]
    Broadcast(Vec<usize>, Vec<usize>),
    #[error("axis {axis} out of range for rank {rank}")]
    Axis { axis: i64, rank: usize },
    #[error("{0}")]
    Invalid(String),
}

fn same_dtype(a: &TensorType, b: &TensorType) -> Result<(), InferError> {
    match a.dtype == b.dtype {
        true => Ok(()),
        false => Err(InferError::DType(a.dtype, b.dtype)),
    }
}

fn bcast(a: &[usize], b: &[usize]) -> Result<Vec<usize>, InferError> {
    broadcast(a, b).ok_or_else(|| InferError::Broadcast(a.to_vec(), b.to_vec()))
}

fn axis_of(axis: i64, rank: usize) -> Result<usize, InferError> {
    norm_axis(axis, rank).ok_or(InferError::Axis { axis, rank })
}

fn invalid<T>(m: impl Into<String>) -> Result<T, InferError> {
    Err(InferError::Invalid(m.into()))
}

fn matmul(x: &TensorType, y: &TensorType) -> Result<TensorType, InferError> {
    same_dtype(x, y)?;
    let (a, b) = (&x.shape, &y.shape);
    if a.len() < 2 || b.len() < 2 {
        return invalid(format!("MatMul needs rank >= 2, got {a:?} x {b:?}"));
    }
    let (m, k1) = (a[a.len() - 2], a[a.len() - 1]);
    let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
    if k1 != k2 {
        return invalid(format!("MatMul inner dims differ: {a:?} x {b:?}"));
    }
    let mut s = bcast(&a[..a.len() - 2], &b[..b.len() - 2])?;
    s.extend([m, n]);
    Ok(TensorType::new(x.dtype, &s))
}

fn reduce_mean(x: &TensorType, axes: &[i64], keepdims: bool) -> Result<TensorType, InferError> {
    let r = x.shape.len();
    let ax: Vec<usize> = axes
        .iter()
        .map(|&a| axis_of(a, r))
        .collect::<Result<_, _>>()?;
    let s: Vec<usize> = (0..r)
        .filter_map(|i| match ax.contains(&i) {
            true => keepdims.then_some(1),
            false => Some(x.shape[i]),
        })
        .collect();
    Ok(TensorType::new(x.dtype, &s))
}

fn reshape(x: &TensorType, shape: &[i64]) -> Result<TensorType, InferError> {
    let n = x.numel();
    let mut out: Vec<usize> = Vec::new();
    let mut infer_at = None;
    for (i, &d) in shape.iter().enumerate() {
        match d {
            -1 if infer_at.replace(i).is_some() => return invalid("more than one -1 in Reshape"),
            -1 => out.push(1),
            0 => match x.shape.get(i) {
                Some(&d) => out.push(d),
                None => return invalid("0 in Reshape past input rank"),
            },
            d if d > 0 => out.push(d as usize),
            _ => return invalid(format!("bad Reshape dim {d}")),
        }
    }
    let p: usize = out.iter().product();
    if let Some(i) = infer_at {
        if p == 0 || !n.is_multiple_of(p) {
            return invalid(format!("cannot reshape {:?} to {shape:?}", x.shape));
        }
        out[i] = n / p;
    } else if p != n {
        return invalid(format!(
            "cannot reshape {:?} ({n} elements) to {shape:?}",
            x.shape
        ));
    }
    Ok(TensorType::new(x.dtype, &out))
}

fn transpose(x: &TensorType, perm: &[usize]) -> Result<TensorType, InferError> {
    let r = x.shape.len();
    let mut seen = perm.to_vec();
    seen.sort();
    if seen != (0..r).collect::<Vec<_>>() {
        return invalid(format!("perm {perm:?} is not a permutation of rank {r}"));
    }
    Ok(TensorType::new(
        x.dtype,
        &perm.iter().map(|&p| x.shape[p]).collect::<Vec<_>>(),
    ))
}

fn concat(ins: &[&TensorType], axis: i64) -> Result<TensorType, InferError> {
    let Some(first) = ins.first() else {
        return invalid("Concat of nothing");
    };
    let r = first.shape.len();
    let a = axis_of(axis, r)?;
    let mut s = first.shape.clone();
    for t in &ins[1..] {
        same_dtype(first, t)?;
        if t.shape.len() != r || (0..r).any(|i| i != a && t.shape[i] != s[i]) {
            return invalid(format!(
                "Concat shapes {:?} and {:?} differ off axis {a}",
                first.shape, t.shape
            ));
        }
        s[a] += t.shape[a];
    }
    Ok(TensorType::new(first.dtype, &s))
}

fn slice(
    x: &TensorType,
    starts: &[i64],
    ends: &[i64],
    axes: &[i64],
) -> Result<TensorType, InferError> {
    let mut s = x.shape.clone();
    for ((&st, &en), &ax) in starts.iter().zip(ends).zip(axes) {
        let a = axis_of(ax, s.len())?;
        let d = s[a] as i64;
        let cl = |x: i64| if x < 0 { (x + d).max(0) } else { x.min(d) };
        s[a] = (cl(en) - cl(st)).max(0) as usize;
    }
    Ok(TensorType::new(x.dtype, &s))
}

fn gather(x: &TensorType, idx: &TensorType, axis: i64) -> Result<TensorType, InferError> {
    if !matches!(idx.dtype, DType::I32 | DType::I64) {
        return invalid("Gather indices must be int32/int64");
    }
    let a = axis_of(axis, x.shape.len())?;
    let mut s = x.shape[..a].to_vec();
    s.extend(&idx.shape);
    s.extend(&x.shape[a + 1..]);
    Ok(TensorType::new(x.dtype, &s))
}

fn scatter_nd(d: &TensorType, i: &TensorType, u: &TensorType) -> Result<TensorType, InferError> {
    if i.dtype != DType::I64 {
        return invalid("ScatterND indices must be int64");
    }
    let Some(&k) = i.shape.last() else {
        return invalid("ScatterND indices rank 0");
    };
    let mut want = i.shape[..i.shape.len() - 1].to_vec();
    want.extend(&d.shape[k.min(d.shape.len())..]);
    if k > d.shape.len() || u.shape != want {
        let m = format!(
            "ScatterND updates {:?} do not fit data {:?} / indices {:?}",
            u.shape, d.shape, i.shape
        );
        return invalid(m);
    }
    same_dtype(d, u)?;
    Ok(d.clone())
}

fn unsqueeze(x: &TensorType, axes: &[i64]) -> Result<TensorType, InferError> {
    let r = x.shape.len() + axes.len();
    let ax: Vec<usize> = axes
        .iter()
        .map(|&a| axis_of(a, r))
        .collect::<Result<_, _>>()?;
    let mut it = x.shape.iter();
    let s: Vec<usize> = (0..r)
        .map(|i| {
            if ax.contains(&i) {
                1
            } else {
                *it.next().expect("rank + axes")
            }
        })
        .collect();
    Ok(TensorType::new(x.dtype, &s))
}
