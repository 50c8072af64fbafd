//! Tokenizer (`tokenizer.json` through the `tokenizers` crate) and the Gemma-4 chat template.
//!
//! The template is the checkpoint's own (`chat_template.jinja` or `tokenizer_config.json`'s `chat_template`),
//! rendered with minijinja exactly as transformers' `apply_chat_template` renders it, and then tokenized
//! without adding special tokens (the template writes `<bos>` itself). Without a template in the checkpoint
//! the built-in Gemma-4 layout is used:
//! `<bos><|turn>system\n{s}<turn|>\n` `<|turn>user\n{u}<turn|>\n` `<|turn>model\n{m}<turn|>\n` … `<|turn>model\n`.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const BOS: u32 = 2;
pub const EOS: u32 = 1;
pub const TURN_OPEN: u32 = 105;
pub const TURN_CLOSE: u32 = 106;
/// Generation stops on either of these.
pub const STOP_IDS: [u32; 2] = [TURN_CLOSE, EOS];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn user(s: &str) -> Self {
        Message {
            role: "user".into(),
            content: s.into(),
        }
    }
}

pub struct Tokenizer {
    pub path: PathBuf,
    inner: tokenizers::Tokenizer,
    template: Option<String>,
    bos_token: String,
    eos_token: String,
}

const BUILTIN_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}<|turn>{{ role }}\n{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}";

impl Tokenizer {
    /// Load `tokenizer.json` from a checkpoint directory (+ its chat template, if any).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::Tokenizer {
                path,
                msg: "not found".into(),
            });
        }
        let json = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let jinja = dir.join("chat_template.jinja");
        let template = match jinja.exists() {
            true => Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?),
            false => None,
        };
        let tc = dir.join("tokenizer_config.json");
        let config = match tc.exists() {
            true => Some(std::fs::read_to_string(&tc).map_err(|e| Error::io(&tc, e))?),
            false => None,
        };
        Self::from_parts(&path, &json, config.as_deref(), template)
    }

    /// From the files' contents (a GGUF carries them as metadata: `hexq_import::tokenizer::files`);
    /// `path` names them in errors.
    pub fn from_parts(
        path: &Path,
        tokenizer_json: &[u8],
        tokenizer_config: Option<&str>,
        mut template: Option<String>,
    ) -> Result<Self> {
        let path = path.to_path_buf();
        let inner =
            tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| Error::Tokenizer {
                path: path.clone(),
                msg: e.to_string(),
            })?;
        let mut bos_token = "<bos>".to_string();
        let mut eos_token = "<eos>".to_string();
        if let Some(text) = tokenizer_config {
            let tc = path.with_file_name("tokenizer_config.json");
            let v: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| Error::file(&tc, format!("invalid JSON: {e}")))?;
            if template.is_none() {
                template = v
                    .get("chat_template")
                    .and_then(|t| t.as_str())
                    .map(str::to_string);
            }
            let tokstr = |k: &str| {
                v.get(k).and_then(|t| {
                    t.as_str()
                        .map(str::to_string)
                        .or_else(|| t.get("content")?.as_str().map(str::to_string))
                })
            };
            if let Some(b) = tokstr("bos_token") {
                bos_token = b;
            }
            if let Some(e) = tokstr("eos_token") {
                eos_token = e;
            }
        }
        Ok(Tokenizer {
            path,
            inner,
            template,
            bos_token,
            eos_token,
        })
    }

    pub fn has_checkpoint_template(&self) -> bool {
        self.template.is_some()
    }

    /// Plain text → ids, no special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let e = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })?;
        Ok(e.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })
    }

    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.inner.token_to_id(t)
    }
    /// The same tokens at the same ids (the added tokens included).
    pub fn same_vocab(&self, other: &Tokenizer) -> bool {
        self.inner.get_vocab(true) == other.inner.get_vocab(true)
    }
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Render the chat template to text.
    pub fn render_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let src = self.template.as_deref().unwrap_or(BUILTIN_TEMPLATE);
        let mut env = minijinja::Environment::new();
        // transformers renders with trim_blocks + lstrip_blocks and Python string methods.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let terr = |e: minijinja::Error| Error::Tokenizer {
            path: self.path.clone(),
            msg: format!("chat template: {e:#}"),
        };
        env.add_template("chat", src).map_err(terr)?;
        let tmpl = env.get_template("chat").map_err(terr)?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(terr)
    }

    /// Chat-formatted prompt ids (what the model sees): template rendered, then tokenized without extra specials.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, true)?;
        self.encode(&text)
    }

    /// Single user turn.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        self.encode_chat(&[Message::user(prompt)])
    }
}
