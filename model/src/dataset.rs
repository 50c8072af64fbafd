//! The prompt sets every stage reads (calibration, held-out evaluation, ablation): JSONL, one record a
//! line, chat `messages` (rendered by the checkpoint's template, [`crate::chat`]) or raw `text`.

use crate::chat::Message;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One prompt: chat messages, or raw text (which calibration refuses unless forced).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    #[serde(default)]
    pub text: Option<String>,
}

/// Read a JSONL dataset; every line must be an object with `id` and `messages` or `text`.
pub fn load_dataset(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: Record = serde_json::from_str(line)
            .map_err(|e| Error::file(path, format!("line {}: {e}", i + 1)))?;
        let at = |m: String| Error::file(path, format!("line {} ({}): {m}", i + 1, r.id));
        match &r.messages {
            None if r.text.is_none() => return Err(at("needs \"messages\" or \"text\"".into())),
            Some(m) if m.is_empty() => return Err(at("\"messages\" is empty".into())),
            Some(m) => {
                // The roles Gemma's chat templates render.
                if let Some(x) = m
                    .iter()
                    .find(|x| !["system", "user", "model", "assistant"].contains(&x.role.as_str()))
                {
                    return Err(at(format!(
                        "role {:?} (expected system, user, model or assistant)",
                        x.role
                    )));
                }
            }
            None => {}
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(Error::file(path, "no records"));
    }
    Ok(out)
}
