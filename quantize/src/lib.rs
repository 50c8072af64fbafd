//! Quantizers: A16W8 encodings (AIMET/QNN min-max), int8 KV, q4_0/q8_0 bit-identical to ggml, ablation grids. Filled by issues 5 and 7.
