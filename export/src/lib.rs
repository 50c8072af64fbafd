//! Exporters: ONNX graphs with vocab tensors split off to host files, encodings JSON, GGUF. Filled by issues 6 and 7.
