//! The slice kernels of hexq: every number the interpreter, calibration, quantsim and ablation compute in a
//! MatMul, a Softmax, a Sigmoid or a mean goes through here, summed in the order onnxruntime's CPU EP sums it
//! (MLAS, Eigen), so a QDQ graph in onnxruntime reproduces hexq's quantsim bit for bit and a batch of prompts
//! gives the values one prompt gives. Each kernel is a plain reference function plus its AVX2/AVX-512
//! builds, tested against the reference bit for bit (onnxruntime keeps MLAS apart the same way).
//!
//! May import: std, rayon, memmap2, libc — no other hexq crate, no tensor library: slices in, slices out.
//! Weight storage is one public type, [`RowWeight`].

pub mod convert;
pub mod dot;
pub mod logistic;
pub mod reduce;
pub mod rowmm;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod softmax;

pub use dot::{matmul_slices, matmul_strided};
pub use logistic::logistic;
pub use reduce::mean_row;
pub use rowmm::{dot_m1, RowWeight};
pub use softmax::softmax_row;

use rayon::prelude::*;

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
