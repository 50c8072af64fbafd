//! hexq-gguf: the ggml/GGUF formats as facts and small exact functions, shared by the GGUF writer (export),
//! the weight grids (eval) and GGUF import.
//!
//! - [`ggml`]: the ggml type table (ids, block sizes, bytes) and the q4_0 / q8_0 / q6_K quantizers of
//!   ggml-quants.c, bit for bit;
//! - [`dequant`]: dequantizers for F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, bit-identical to gguf-py;
//! - [`reader`]: a bounds-checked GGUF reader (header, key-values, tensor infos, mapped data);
//! - [`weighted`]: the importance-weighted q4_0 quantizer (`quantize_row_q4_0_impl` with an imatrix);
//! - [`imatrix`]: llama.cpp's importance-matrix files (GGUF and legacy `.dat`), read and written.
//!
//! May import: std, half, memmap2 — no other hexq crate: the format's facts, read and written by model, export and import.

pub mod dequant;
pub mod ggml;
pub mod imatrix;
pub mod reader;
pub mod weighted;

pub use reader::{GgufError, GgufFile, TensorInfo, Value, ValueType};
