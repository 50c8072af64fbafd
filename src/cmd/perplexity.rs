//! `hexq perplexity`: llama-perplexity's measure on any backend (hexq_eval::perplexity holds the protocol).
//! Without `--kl-base`: PPL ± error over the text's chunks (and, with `--save-logits`, the base file for a
//! later KLD run, in llama-perplexity's own format). With `--kl-base F` (hexq's or llama-perplexity's): the
//! tokens come from F, and the KLD / same-top / Δp statistics are reported beside PPL.

use super::run::{open_backend, BackendArgs};
use anyhow::Result;
use hexq_eval::perplexity as pp;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub b: BackendArgs,
    /// The text, as llama-perplexity's -f (UTF-8; tokenized once with BOS, no special tokens parsed).
    #[arg(long, required_unless_present = "kl_base")]
    pub text: Option<PathBuf>,
    /// Tokens per chunk (llama-perplexity's -c).
    #[arg(long, default_value_t = 512, value_parser = super::positive)]
    pub ctx: usize,
    /// Use at most N chunks (llama-perplexity's --chunks).
    #[arg(long, value_parser = super::positive)]
    pub chunks: Option<usize>,
    /// Write every scored position's log-probabilities as llama-perplexity's --kl-divergence-base file.
    #[arg(long, conflicts_with = "kl_base")]
    pub save_logits: Option<PathBuf>,
    /// KL divergence against a base file (hexq's --save-logits or llama-perplexity's
    /// --kl-divergence-base); its tokens and context are used.
    #[arg(long)]
    pub kl_base: Option<PathBuf>,
    /// graph backend: quantsim of this encodings file (GPTQ weights beside it overlaid).
    #[arg(long)]
    pub encodings: Option<PathBuf>,
    /// Replace an existing --save-logits file.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

/// The backend a run scores: `open_backend`'s, or quantsim of `encodings` on the graph backend (shared with
/// `hexq mmlu`).
pub fn backend(
    b: &BackendArgs,
    encodings: Option<&PathBuf>,
) -> Result<(Box<dyn hexq_runtime::Backend>, hexq_model::chat::Tokenizer)> {
    let Some(e) = encodings else {
        return open_backend(b);
    };
    if !matches!(b.backend, super::run::BackendKind::Graph) {
        anyhow::bail!("--encodings needs --backend graph (quantsim runs on hexq's graph)");
    }
    let dir = super::model_dir(b.model.clone())?;
    let enc: hexq_quantize::Encodings = super::read_json(e)?;
    let mut q = hexq_model::Checkpoint::open(&dir)?;
    hexq_quantize::rounding::open_overlay(&mut q, &enc, e)?;
    // The graph the encodings were made on (their tensor names are its), checked as `export` checks them.
    let o = hexq_graph::GraphOptions {
        context: enc.hexq["context"].as_u64().unwrap_or(4096) as usize,
        seq: enc.hexq["seq"].as_u64().unwrap_or(128).max(1) as usize,
    };
    super::check_context(&q.config, o.context, e, "hexq.context")?;
    let gr = hexq_graph::build(&q.config, hexq_graph::Variant::DecodeWgqa, &o);
    hexq_export::check_encodings(&gr, &enc, false, e, true)?;
    drop(gr);
    let g = hexq_eval::verify::quantsim(
        &std::sync::Arc::new(q),
        &enc,
        hexq_graph::Variant::DecodeWgqa,
        &o,
    )?;
    Ok((Box::new(g), hexq_model::chat::Tokenizer::from_dir(&dir)?))
}

pub fn run(a: Args) -> Result<()> {
    if let Some(p) = &a.save_logits {
        super::refuse_existing(p, a.force)?;
    }
    let (mut b, tok) = backend(&a.b, a.encodings.as_ref())?;
    let bos = tok
        .token_to_id("<bos>")
        .ok_or_else(|| anyhow::anyhow!("the tokenizer has no <bos> token"))?;
    let mut base = a.kl_base.as_deref().map(pp::BaseReader::open).transpose()?;
    let (tokens, ctx) = match (&base, &a.text) {
        (Some(r), _) => (r.tokens.clone(), r.ctx),
        (None, Some(t)) => {
            let text =
                std::fs::read_to_string(t).map_err(|e| anyhow::anyhow!("{}: {e}", t.display()))?;
            let mut ids = vec![bos];
            ids.extend(tok.encode(&text)?);
            (ids, a.ctx)
        }
        (None, None) => unreachable!("clap requires --text or --kl-base"),
    };
    if let Some(cap) = b.capacity() {
        if ctx > cap {
            anyhow::bail!("--ctx {ctx} exceeds the backend's {cap} positions (raise --context)");
        }
    }
    let chunks = match &base {
        Some(r) => (0..r.n_chunk.min(a.chunks.unwrap_or(usize::MAX)))
            .map(|i| &tokens[i * ctx..(i + 1) * ctx])
            .collect(),
        None => pp::chunks(&tokens, ctx, a.chunks).map_err(|e| {
            anyhow::anyhow!(
                "{}: {e}",
                a.text
                    .as_ref()
                    .map_or(String::new(), |t| t.display().to_string())
            )
        })?,
    };
    let first = pp::first(ctx);
    let pb = super::count_progress("perplexity");
    pb.set_length(chunks.len() as u64);
    let mut ppl = pp::Ppl::default();
    let mut kld = pp::Kld::default();
    let mut save = None;
    let mut n_vocab = 0;
    for (ci, chunk) in chunks.iter().enumerate() {
        b.reset();
        let logits = b.feed_all(&pp::with_bos(chunk, bos), first)?;
        n_vocab = logits[0].len();
        if ci == 0 {
            if let (Some(p), None) = (&a.save_logits, &base) {
                save = Some(pp::BaseWriter::create(
                    p,
                    ctx,
                    n_vocab,
                    chunks.len(),
                    &tokens,
                )?);
            }
            if let Some(r) = &base {
                if r.n_vocab != n_vocab {
                    anyhow::bail!(
                        "{}: a vocabulary of {}, the backend's has {n_vocab}",
                        a.kl_base.as_ref().unwrap().display(),
                        r.n_vocab
                    );
                }
            }
        }
        for (i, l) in logits.iter().take(pp::scored(ctx)).enumerate() {
            let next = chunk[first + i + 1];
            match (&mut base, &mut save) {
                (Some(r), _) => kld.add(l, r.next_row()?, next),
                (None, Some(w)) => w.add(l, next)?,
                (None, None) => ppl.add(l, next),
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    let mut r = match (&base, save) {
        (Some(_), _) => kld.report(),
        (None, Some(w)) => stats(&w.finish()?),
        (None, None) => stats(&ppl),
    };
    r["backend"] = b.name().into();
    r["chunks"] = chunks.len().into();
    r["ctx"] = ctx.into();
    r["n_vocab"] = n_vocab.into();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_report(&r);
    }
    Ok(())
}

fn stats(p: &pp::Ppl) -> serde_json::Value {
    let (ppl, err) = p.result();
    serde_json::json!({"ppl": ppl, "ppl_err": err, "count": p.count})
}

fn print_report(r: &serde_json::Value) {
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "{} chunks of {} on {}: PPL = {:.4} +/- {:.5} ({} positions)",
        r["chunks"],
        r["ctx"],
        r["backend"].as_str().unwrap_or(""),
        f("ppl"),
        f("ppl_err"),
        r["count"]
    );
    if r.get("kld_mean").is_some() {
        println!(
            "PPL(base)   {:.4} +/- {:.5}",
            f("ppl_base"),
            f("ppl_base_err")
        );
        println!("Mean KLD    {:.6} +/- {:.6}", f("kld_mean"), f("kld_err"));
        println!("Median KLD  {:.6}", f("kld_median"));
        println!("99.0% KLD   {:.6}", f("kld_p99"));
        println!("Maximum KLD {:.6}", f("kld_max"));
        println!("RMS Δp      {:.3} %", 100.0 * f("rms_dp"));
        println!(
            "Same top p  {:.3} ± {:.3} %",
            100.0 * f("same_top"),
            100.0 * f("same_top_err")
        );
    }
}
