//! `hexq imatrix`: llama.cpp's importance matrix (Σx² per input column of every `blk.*` weight) from the
//! same chat-formatted decode loops as `calibrate`, written as the GGUF `llama-quantize --imatrix` reads.

use super::{count_progress, model_dir};
use anyhow::Result;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::chat::Tokenizer;
use hexq_model::Checkpoint;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// JSONL chat prompts (datasets/calibration.jsonl).
    #[arg(long, default_value = "datasets/calibration.jsonl")]
    pub dataset: PathBuf,
    /// Use only the first N prompts.
    #[arg(long, value_parser = super::positive)]
    pub limit: Option<usize>,
    /// Tokens generated greedily (and observed) after each prompt.
    #[arg(long, default_value_t = 8)]
    pub decode_tokens: usize,
    #[arg(long, default_value_t = 4096, value_parser = super::positive)]
    pub context: usize,
    /// Decode steps per batched graph run (the sums do not depend on it).
    #[arg(long, default_value_t = 16, value_parser = super::positive)]
    pub batch: usize,
    /// Prompts in flight at once (default: --batch); bounds the KV memory at E2B size.
    #[arg(long, default_value_t = 0)]
    pub sequences: usize,
    /// Worker threads for the weight multiplies (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Leave position 0 (BOS) out of the sums: it is the same for every prompt, and on a trained Gemma its
    /// activations are ~10× any other position's (see hexq_model::prefix), so counted once per prompt it
    /// weighs the columns it is large in far more than llama-imatrix (once per 512-token chunk) does.
    #[arg(long)]
    pub skip_bos: bool,
    /// Turn the guards' refusals (raw-text records, no chat-template tokens) into warnings.
    #[arg(long)]
    pub ignore_guards: bool,
    /// Raw text instead of the chat prompts, as `llama-imatrix -f F -c CHUNK` reads it (for the side by side):
    /// tokenized with BOS, cut into --chunk-token chunks each starting with BOS, each from an empty cache.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// --text: tokens per chunk (llama-imatrix's -c).
    #[arg(long, default_value_t = 512, value_parser = super::positive)]
    pub chunk: usize,
    /// --text: use at most N chunks (llama-imatrix's --chunks).
    #[arg(long, value_parser = super::positive)]
    pub chunks: Option<usize>,
    /// The imatrix GGUF to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace an existing --out.
    #[arg(long)]
    pub force: bool,
}

pub fn run(a: Args) -> Result<()> {
    super::refuse_existing(&a.out, a.force)?;
    let dir = model_dir(a.model.clone())?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let o = hexq_calibrate::Options {
        variant: Variant::DecodeWgqa,
        graph: GraphOptions {
            context: a.context,
            seq: 128,
        },
        decode_tokens: a.decode_tokens,
        limit: a.limit,
        ignore_guards: a.ignore_guards,
        noise: false,
        batch: a.batch,
        sequences: a.sequences,
        checkpoint: None,
        checkpoint_every: usize::MAX,
        tokens_out: None,
        full_rings: false,
        bos_on_graph: !a.skip_bos,
    };
    super::set_threads(a.threads);
    let g = hexq_graph::build(&ck.config, o.variant, &o.graph);
    let sq = Arc::new(hexq_calibrate::imatrix::SquareSums::for_graph(&g));
    let obs = hexq_calibrate::RangeObserver {
        squares: Some(sq.clone()),
        ..Default::default()
    };
    let pb = count_progress("imatrix");
    if let Some(t) = &a.text {
        let chunks = text_chunks(&tok, &ck, t, a.chunk, a.chunks)?;
        let o = hexq_calibrate::Options {
            graph: GraphOptions {
                context: a.chunk + 1,
                seq: 128,
            },
            decode_tokens: 0,
            ..o
        };
        let n = hexq_calibrate::observe_ids(ck.clone(), &chunks, &o, &pb, obs)?;
        pb.finish_and_clear();
        let mut m = imatrix_of(&sq, t, chunks.len(), n);
        m.chunk_size = a.chunk as u32;
        hexq_fsutil::write_atomic(&a.out, &m.to_gguf())?;
        eprintln!(
            "{}: {} weight matrices from {} chunks of {} tokens of {}",
            a.out.display(),
            m.entries.len(),
            chunks.len(),
            a.chunk,
            t.display()
        );
        return Ok(());
    }
    let st = hexq_calibrate::calibrate_with(
        ck.clone(),
        &tok,
        &a.dataset,
        &o,
        &pb,
        obs,
        hexq_calibrate::Engine::Interp { params: None },
        "float".into(),
    )?;
    pb.finish_and_clear();
    let m = imatrix_of(&sq, &a.dataset, st.prompts, st.tokens_observed);
    hexq_fsutil::write_atomic(&a.out, &m.to_gguf())?;
    eprintln!(
        "{}: {} weight matrices from {} prompts ({} tokens, chat-formatted decode loops)",
        a.out.display(),
        m.entries.len(),
        st.prompts,
        st.tokens_observed
    );
    Ok(())
}

/// The file llama-imatrix would write for these sums: a chunk is one prompt's decode loop, its size the
/// mean tokens per prompt (llama.cpp: the context per sequence); the dataset named by its file name only.
fn imatrix_of(
    sq: &hexq_calibrate::imatrix::SquareSums,
    dataset: &std::path::Path,
    prompts: usize,
    tokens: u64,
) -> hexq_gguf::imatrix::Imatrix {
    use hexq_gguf::imatrix::{Entry, Imatrix};
    Imatrix {
        datasets: vec![hexq_fsutil::dir_name(dataset)],
        chunk_count: prompts as u32,
        chunk_size: tokens.div_ceil(prompts.max(1) as u64) as u32,
        entries: sq
            .entries()
            .into_iter()
            .map(|(n, (sums, count))| {
                let e = Entry {
                    sums,
                    counts: vec![count as f32],
                };
                (n, e)
            })
            .collect(),
    }
}

/// llama-imatrix's chunks of a text: the tokens with BOS in front, `chunk` at a time (the remainder dropped),
/// each chunk's first token replaced by BOS; at least two chunks, as it requires.
fn text_chunks(
    tok: &Tokenizer,
    ck: &Checkpoint,
    path: &std::path::Path,
    chunk: usize,
    limit: Option<usize>,
) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let bos = ck.config.bos_token_id;
    let mut ids = vec![bos];
    ids.extend(tok.encode(&text)?);
    if ids.len() < 2 * chunk {
        anyhow::bail!(
            "{}: {} tokens, fewer than two chunks of --chunk {chunk} (llama-imatrix needs as many)",
            path.display(),
            ids.len()
        );
    }
    let n = (ids.len() / chunk).min(limit.unwrap_or(usize::MAX));
    Ok((0..n)
        .map(|i| {
            let mut c = ids[i * chunk..(i + 1) * chunk].to_vec();
            c[0] = bos;
            c
        })
        .collect())
}
