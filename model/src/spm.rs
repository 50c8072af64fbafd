//! `tokenizer.model`: SentencePiece's `ModelProto` (sentencepiece_model.proto), the fields a Gemma
//! vocabulary uses. Gemma-3 checkpoints ship it, and llama.cpp's converter reads the `llama` GGUF
//! vocabulary (pieces, scores, types) from it; `hexq import` writes it back from a GGUF.

use crate::{Error, Result};
use prost::Message;
use std::path::Path;

/// SentencePiece piece types; llama.cpp's `tokenizer.ggml.token_type` uses the same numbers.
pub mod piece_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

#[derive(Clone, PartialEq, Message)]
pub struct Piece {
    #[prost(string, optional, tag = "1")]
    pub piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    pub score: Option<f32>,
    /// [`piece_type`]; absent means NORMAL.
    #[prost(int32, optional, tag = "3")]
    pub r#type: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TrainerSpec {
    /// 1 unigram, 2 BPE.
    #[prost(int32, optional, tag = "3")]
    pub model_type: Option<i32>,
    #[prost(int32, optional, tag = "4")]
    pub vocab_size: Option<i32>,
    #[prost(bool, optional, tag = "25")]
    pub split_digits: Option<bool>,
    #[prost(bool, optional, tag = "26")]
    pub allow_whitespace_only_pieces: Option<bool>,
    #[prost(bool, optional, tag = "35")]
    pub byte_fallback: Option<bool>,
    #[prost(int32, optional, tag = "40")]
    pub unk_id: Option<i32>,
    #[prost(int32, optional, tag = "41")]
    pub bos_id: Option<i32>,
    #[prost(int32, optional, tag = "42")]
    pub eos_id: Option<i32>,
    #[prost(int32, optional, tag = "43")]
    pub pad_id: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
pub struct NormalizerSpec {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(bool, optional, tag = "3")]
    pub add_dummy_prefix: Option<bool>,
    #[prost(bool, optional, tag = "4")]
    pub remove_extra_whitespaces: Option<bool>,
    #[prost(bool, optional, tag = "5")]
    pub escape_whitespaces: Option<bool>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pub pieces: Vec<Piece>,
    #[prost(message, optional, tag = "2")]
    pub trainer_spec: Option<TrainerSpec>,
    #[prost(message, optional, tag = "3")]
    pub normalizer_spec: Option<NormalizerSpec>,
}

impl ModelProto {
    /// A Gemma-style BPE model (byte fallback, digits split, identity normalizer without a dummy prefix)
    /// over `(piece, score, type)`; `ids` = (unk, bos, eos, pad).
    pub fn gemma(pieces: Vec<(String, f32, i32)>, ids: [i32; 4]) -> Self {
        let n = pieces.len() as i32;
        ModelProto {
            pieces: pieces
                .into_iter()
                .map(|(p, s, t)| Piece {
                    piece: Some(p),
                    score: Some(s),
                    r#type: Some(t),
                })
                .collect(),
            trainer_spec: Some(TrainerSpec {
                model_type: Some(2),
                vocab_size: Some(n),
                split_digits: Some(true),
                allow_whitespace_only_pieces: Some(true),
                byte_fallback: Some(true),
                unk_id: Some(ids[0]),
                bos_id: Some(ids[1]),
                eos_id: Some(ids[2]),
                pad_id: Some(ids[3]),
            }),
            normalizer_spec: Some(NormalizerSpec {
                name: Some("identity".into()),
                add_dummy_prefix: Some(false),
                remove_extra_whitespaces: Some(false),
                escape_whitespaces: Some(true),
            }),
        }
    }

    pub fn read(path: &Path) -> Result<Self> {
        let b = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let m = ModelProto::decode(b.as_slice()).map_err(|e| Error::Tokenizer {
            path: path.into(),
            msg: format!("not a SentencePiece model: {e}"),
        })?;
        if m.pieces.iter().any(|p| p.piece.is_none()) {
            return Err(Error::Tokenizer {
                path: path.into(),
                msg: "a piece without text".into(),
            });
        }
        Ok(m)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode_to_vec()
    }

    /// (text, score, type) of piece `i`, with SentencePiece's defaults for absent fields.
    pub fn piece(&self, i: usize) -> (&str, f32, i32) {
        let p = &self.pieces[i];
        (
            p.piece.as_deref().unwrap_or(""),
            p.score.unwrap_or(0.0),
            p.r#type.unwrap_or(piece_type::NORMAL),
        )
    }
}
