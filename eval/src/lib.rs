//! hexq-eval: how far a quantized build is from float, measured the way users judge it.
//!
//! - [`verify`]: quantsim (or any backend) vs the float graph on held-out chat prompts — next-token top-1,
//!   hidden cosine, KL, token-exact greedy, the per-step decode cosine trace, norm collapse, coverage;
//! - [`qnn`]: the same figures for compiled context binaries on QNN HTP (the simulator on x86-64);
//! - [`ablate`]: weights-only grids (per-channel int8/int4, q4_0 and wider groups) side by side;
//! - [`mmlu`]: 0-shot chat-formatted multiple choice, accuracy ± bootstrap SE, per-question agreement;
//! - [`perplexity`]: llama-perplexity's protocol, PPL and KLD statistics, its base-logits file format.
//!
//! May import: model, graph, kernels, runtime, calibrate, quantize, gguf, fsutil; nothing imports it but the CLI.

pub mod ablate;
pub mod mmlu;
pub mod perplexity;
pub mod qnn;
pub mod verify;
