//! Deployable graphs: the IR ([`ir`]), the builders that lower a Gemma-4 config into decode/trunk graphs
//! ([`mod@build`]), and the CPU interpreter every transformation is checked with ([`interp`]).
//!
//! May import: model (config, checkpoint weights), kernels (every MatMul, Softmax, Sigmoid, mean); never runtime or later. The room: `ir.rs` (ops and types), `build/` (the builders), `infer.rs`, `interp/` (the interpreter), `report.rs`.

pub mod build;
pub mod infer;
pub mod interp;
pub mod ir;
pub mod report;

pub use build::{build, GraphOptions, Variant};
pub use ir::{DType, Graph, Op, NEG, OPSET};
