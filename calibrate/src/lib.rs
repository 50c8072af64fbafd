//! Activation-range capture on chat-formatted decode loops. Filled by issue 5.
