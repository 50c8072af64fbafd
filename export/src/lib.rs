//! hexq-export: ONNX graphs from the graph IR with weights as external data (the vocab-sized tensors never
//! enter a graph; they stay host-side). GGUF and host-tensor files are later issues.

pub mod onnx;
pub mod onnx_proto;
