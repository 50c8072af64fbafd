//! Override rules by glob (`layers.*.mlp.*`): a bitwidth or symmetry per tensor kind, the last rule wins.

use hexq_model::{Error, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Activation,
    Param,
}

/// One override rule: tensors whose name matches `pattern` (`*` wildcard) get `bitwidth` (and optionally
/// symmetric / per-tensor). E.g. keep a tensor at 16 bits, or W4 per-channel MLP weights.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Rule {
    pub pattern: String,
    pub kind: Kind,
    pub bitwidth: u32,
    #[serde(default)]
    pub symmetric: Option<bool>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Overrides {
    pub rules: Vec<Rule>,
}

pub fn glob(p: &str, s: &str) -> bool {
    let parts: Vec<&str> = p.split('*').collect();
    if parts.len() == 1 {
        return p == s;
    }
    let mut rest = s;
    for (i, part) in parts.iter().enumerate() {
        if i == 0 {
            if !rest.starts_with(part) {
                return false;
            }
            rest = &rest[part.len()..];
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else if let Some(k) = rest.find(part) {
            rest = &rest[k + part.len()..];
        } else {
            return false;
        }
    }
    true
}

impl Overrides {
    pub fn from_file(p: &std::path::Path) -> Result<Self> {
        let t = std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?;
        let o: Overrides = serde_json::from_str(&t)
            .map_err(|e| Error::file(p, format!("invalid overrides: {e}")))?;
        for r in &o.rules {
            if !(2..=16).contains(&r.bitwidth) {
                return Err(Error::file(
                    p,
                    format!(
                        "rule {:?}: bitwidth {} not in 2..=16",
                        r.pattern, r.bitwidth
                    ),
                ));
            }
        }
        Ok(o)
    }
    /// The rules that match no tensor of `g` (params: its initializers; activations: its inputs and node
    /// outputs) — most often a misspelt pattern, which would otherwise change nothing silently.
    pub fn unmatched(&self, g: &hexq_graph::ir::Graph) -> Vec<&Rule> {
        let params: Vec<&str> = g.initializers.iter().map(|i| i.name.as_str()).collect();
        let acts: Vec<&str> = g
            .inputs
            .iter()
            .map(|i| i.name.as_str())
            .chain(
                g.nodes
                    .iter()
                    .flat_map(|n| n.outputs.iter().map(String::as_str)),
            )
            .collect();
        self.rules
            .iter()
            .filter(|r| {
                let names = if r.kind == Kind::Param {
                    &params
                } else {
                    &acts
                };
                !names.iter().any(|n| glob(&r.pattern, n))
            })
            .collect()
    }
    pub(crate) fn find(&self, kind: Kind, name: &str) -> Option<&Rule> {
        self.rules
            .iter()
            .rev()
            .find(|r| r.kind == kind && glob(&r.pattern, name))
    }
}
