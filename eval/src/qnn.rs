//! `hexq verify --backend qnn|ort`: per export × execution provider — the compiled binary on QNN HTP (the
//! simulator on x86-64) for each target, or the QDQ graph in onnxruntime's CPU EP — vs float and vs hexq's
//! quantsim, with quantsim vs float as the baseline: the offline answer to "will the device match quantsim?".

use crate::verify::{backend, compare, compare_many, quantsim, Report};
use hexq_graph::{GraphOptions, Variant};
use hexq_model::chat::Tokenizer;
use hexq_model::dataset::Record;
use hexq_model::{Checkpoint, Error, Result};
use hexq_runtime::ort::{manifest, Ep, OrtBackend};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

/// One line of the table: `candidate` measured against `reference` for one export on one target
/// (`target` is "-" for the quantsim-vs-float baseline).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub variant: String,
    pub target: String,
    pub candidate: String,
    pub reference: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contexts_created: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_buffers_allocated: Option<usize>,
    pub report: Report,
}

/// Every export in `artifacts` on every execution provider; `progress(label)` makes a bar per comparison.
pub fn verify_exports(
    ck: &Arc<Checkpoint>,
    tok: &Tokenizer,
    recs: &[Record],
    artifacts: &[PathBuf],
    eps: &[Ep],
    steps: usize,
    progress: &dyn Fn(&str) -> indicatif::ProgressBar,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for a in artifacts {
        let m = manifest(a)?;
        let vname = m["variant"].as_str().unwrap_or_default().to_string();
        let v = Variant::parse(&vname).ok_or_else(|| {
            Error::file(
                &a.join("manifest.json"),
                format!("unknown variant {vname:?}"),
            )
        })?;
        let o = GraphOptions {
            context: m["graph"]["context"].as_u64().unwrap_or(4096) as usize,
            seq: m["graph"]["seq"].as_u64().unwrap_or(128) as usize,
        };
        let encp = a.join(format!("{vname}.encodings.json"));
        let enc = hexq_quantize::Encodings::from_file(&encp)?;
        let st = if v.is_trunk() { 0 } else { steps };
        let mut float = backend(ck, v, &o)?;
        let mut qs = quantsim(ck, &enc, v, &o)?;
        let pb = progress(&format!("{vname}: quantsim vs float"));
        let r = compare(&vname, &mut float, &mut qs, tok, recs, o.context, st, &pb)?;
        pb.finish_and_clear();
        rows.push(row(&vname, "-", "quantsim", "float", None, r));
        // Every execution provider's candidate at once against one run of the references.
        let mut cands = Vec::new();
        for ep in eps {
            let (t, cand) = match ep {
                Ep::Qnn { target } => (target.clone(), "htp"),
                Ep::Cpu => ("ort-cpu".to_string(), "ort"),
            };
            cands.push((
                t,
                cand,
                OrtBackend::open(std::slice::from_ref(a), 1, ep.clone())?,
            ));
        }
        if cands.is_empty() {
            continue;
        }
        let names: Vec<String> = cands.iter().map(|c| format!("{} {}", c.1, c.0)).collect();
        let pb = progress(&format!(
            "{vname}: {} vs float and quantsim",
            names.join(", ")
        ));
        let refs: &mut [&mut dyn hexq_runtime::Hidden] = &mut [&mut float, &mut qs];
        let mut cs: Vec<&mut (dyn hexq_runtime::Hidden + Send)> = cands
            .iter_mut()
            .map(|c| &mut c.2 as &mut (dyn hexq_runtime::Hidden + Send))
            .collect();
        let rs = compare_many(&vname, refs, &mut cs, tok, recs, o.context, st, &pb)?;
        pb.finish_and_clear();
        for ((t, cand, b), rs) in cands.iter().zip(rs) {
            let counts = (b.sessions_created, b.kv_buffers_allocated);
            for (refname, r) in ["float", "quantsim"].into_iter().zip(rs) {
                rows.push(row(&vname, t, cand, refname, Some(counts), r));
            }
        }
    }
    Ok(rows)
}

fn row(v: &str, t: &str, cand: &str, rf: &str, counts: Option<(usize, usize)>, r: Report) -> Row {
    Row {
        variant: v.into(),
        target: t.into(),
        candidate: cand.into(),
        reference: rf.into(),
        contexts_created: counts.map(|c| c.0),
        kv_buffers_allocated: counts.map(|c| c.1),
        report: r,
    }
}

/// The rows as one Markdown table.
pub fn markdown(rows: &[Row]) -> String {
    let mut s = String::from("| variant | target | candidate vs reference | top-1 | hidden cos mean / min | KL mean / max | greedy exact | decode cos per step (mean) |\n|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let p = &r.report;
        let tr: Vec<String> = p
            .step_cosine_mean
            .iter()
            .map(|c| format!("{c:.4}"))
            .collect();
        let greedy = if p.greedy_steps > 0 {
            format!(
                "{}/{} ({} steps)",
                p.greedy_exact, p.prompts, p.greedy_steps
            )
        } else {
            "-".into()
        };
        let trace = if tr.is_empty() {
            "-".into()
        } else {
            tr.join(" → ")
        };
        s += &format!(
            "| {} | {} | {} vs {} | {:.1} % | {:.5} / {:.5} | {:.2e} / {:.2e} | {greedy} | {trace} |\n",
            r.variant,
            r.target,
            r.candidate,
            r.reference,
            100.0 * p.top1_agreement,
            p.cosine_mean,
            p.cosine_min,
            p.kl_mean,
            p.kl_max,
        );
    }
    s
}
