//! Deployable graphs: the IR ([`ir`]), the builders that lower a Gemma-4 config into decode/trunk graphs
//! ([`build`]), and the CPU interpreter every transformation is checked with ([`interp`]).

pub mod build;
mod chain;
mod dot;
pub mod infer;
pub mod interp;
pub mod ir;
mod ops;
pub mod report;
pub mod rowmm;

pub use build::{build, GraphOptions, Variant};
pub use dot::matmul_slices;
pub use ir::{DType, Graph, Op, NEG, OPSET};
pub use ops::{logistic, mean_row, softmax_row};
