//! `hexq mmlu`: 0-shot chat-formatted multiple choice on any backend (hexq_eval::mmlu holds the protocol).

use super::run::BackendArgs;
use anyhow::Result;
use hexq_eval::mmlu;
use hexq_model::chat::Message;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub b: BackendArgs,
    /// Questions: the MMLU release's CSV layout (`<subject>_test.csv`) or JSONL.
    #[arg(long)]
    pub data: PathBuf,
    /// Use only the first N questions.
    #[arg(long, value_parser = super::positive)]
    pub limit: Option<usize>,
    /// graph backend: quantsim of this encodings file (GPTQ weights beside it overlaid).
    #[arg(long)]
    pub encodings: Option<PathBuf>,
    /// The calibration set the questions must not appear in.
    #[arg(long, default_value = "datasets/calibration.jsonl")]
    pub calibration: PathBuf,
    /// Another run's `--json` report on the same questions: per-question agreement.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let mut qs = mmlu::load(&a.data).map_err(anyhow::Error::msg)?;
    qs.truncate(a.limit.unwrap_or(usize::MAX));
    let cal: Vec<String> = hexq_model::dataset::load_dataset(&a.calibration)?
        .into_iter()
        .flat_map(|r| {
            r.messages
                .unwrap_or_default()
                .into_iter()
                .map(|m| m.content)
                .chain(r.text)
        })
        .collect();
    let hit = mmlu::overlap(&qs, &cal);
    if let Some(&i) = hit.first() {
        anyhow::bail!(
            "{}: {} question(s) appear in the calibration set {} (the first: {:?}); evaluate on questions \
             disjoint from calibration",
            a.data.display(),
            hit.len(),
            a.calibration.display(),
            qs[i].question
        );
    }
    let (mut b, tok) = super::perplexity::backend(&a.b, a.encodings.as_ref())?;
    let mut ids = [0u32; 4];
    for (k, l) in mmlu::LETTERS.iter().enumerate() {
        match tok.encode(l)?.as_slice() {
            [id] => ids[k] = *id,
            other => anyhow::bail!(
                "the tokenizer spells {l:?} as {} tokens, not one",
                other.len()
            ),
        }
    }
    let pb = super::count_progress("mmlu");
    pb.set_length(qs.len() as u64);
    let mut chosen = Vec::with_capacity(qs.len());
    for q in &qs {
        b.reset();
        let p = tok.encode_chat(&[Message::user(&mmlu::prompt(q))])?;
        let logits = b.feed(&p)?;
        chosen.push(mmlu::choose(&logits, &ids));
        pb.inc(1);
    }
    pb.finish_and_clear();
    let mut r = mmlu::report(&qs, &chosen);
    r["backend"] = b.name().into();
    r["data"] = a
        .data
        .file_name()
        .map(|f| f.to_string_lossy().to_string())
        .into();
    if let Some(c) = &a.compare {
        let other: serde_json::Value = super::read_json(c)?;
        let theirs: Vec<String> = other["answers"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let ours: Vec<String> = chosen
            .iter()
            .map(|&c| mmlu::LETTERS[c].to_string())
            .collect();
        let ag = mmlu::agreement(&ours, &theirs).ok_or_else(|| {
            anyhow::anyhow!(
                "{}: {} answers, this run has {}",
                c.display(),
                theirs.len(),
                ours.len()
            )
        })?;
        r["agreement"] = ag.into();
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{} questions on {}: accuracy {:.2} ± {:.2} %",
            qs.len(),
            b.name(),
            100.0 * f("accuracy"),
            100.0 * f("accuracy_se")
        );
        for s in r["subjects"].as_array().into_iter().flatten() {
            println!(
                "  {:<40} {}/{}",
                s["subject"].as_str().unwrap_or(""),
                s["correct"],
                s["questions"]
            );
        }
        if r.get("agreement").is_some() {
            println!(
                "agreement with {}: {:.1} %",
                a.compare.as_ref().unwrap().display(),
                100.0 * f("agreement")
            );
        }
    }
    Ok(())
}
