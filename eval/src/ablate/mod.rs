//! Weight-grid ablation: the same model with its decoder weights on different grids (weights only,
//! activations float), side by side against float — the per-channel vs group-wise comparison the published
//! 4-bit build rests on (granularity, not bit-width, decides accuracy). Rows may also be whole builds
//! ([`Build`]: an encodings file's params *and* activations, as `hexq verify` runs them), so A16W8 and
//! w4a16 sit in the same table as the weights-only grids, every figure over the same positions.
//!
//! Grids (all symmetric): `int8-pc` / `int4-pc` per output channel (AIMET's rule, [`hexq_quantize::Encoding`]);
//! `q4_0-g32` ggml's q4_0 exactly ([`hexq_gguf::ggml`]); `g64` / `g128` the same q4_0 rule over 64/128-wide
//! groups; `int4-pc-mlp-only` int4 per channel on the MLP, attention float; `lpbq-b32` / `b64` / `b128`
//! Qualcomm's w4a16 weight grid (LPBQ, aimet-onnx's arithmetic exactly: [`hexq_quantize::lpbq`]).
//!
//! `heavy_tail`: random checkpoints lack the outlier input channels real LLMs have, so every grid looks
//! alike on them. This option gives the inputs of q/k/v and gate/up heavy-tailed per-channel scales s_j
//! (log-normal, σ = 1: a few channels 20× and more) *without changing the float function*: W·diag(s) with the
//! preceding RMSNorm weight divided by s (x·w/s feeds W·s). Float stays float; the grids now face outliers.

//!
//! The room: `mod.rs` (the passes and the report's figures), `grid.rs` (grids and the hooks that bake
//! them), `rounded.rs` (the calibration-aware roundings and the head's grid per row), `report.rs` (tables
//! and the plot).

mod grid;
mod report;
mod rounded;

use crate::verify::cos;
pub use grid::{apply_grid, class_of, heavy_scales, sqnr_db, Build, Grid, GridHook, Scheme};
use grid::{err_sums, resolve, row_grid, Measured, Sqnr};
use hexq_graph::Variant;
use hexq_model::names::Role;
use hexq_quantize::quantsim::FakeQuant;
use hexq_runtime::graph::GraphBackend;
pub use rounded::{imatrix_groups, Cell, ClassSums, Head, Inputs, Rounding};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// The grid (`q4_0-g32`, `lpbq-b64`, …) or the build's name.
    pub scheme: String,
    /// How the weights were rounded onto it: rtn, imatrix, seqmse, gptq, seqmse-gptq.
    pub rounding: String,
    /// The tied embedding / LM head: float, q8_0, int8-pc or `same` (the row's grid).
    pub head: String,
    /// "float" (a weights-only grid) or a build's activation grid ("int16").
    pub activations: String,
    pub bits_per_weight: f64,
    /// Decoder weights (quantized at their grid, the rest bf16), MiB; host-side embeddings excluded.
    pub decoder_mib: f64,
    pub sqnr_db: BTreeMap<String, f64>,
    pub top1_agreement: f64,
    pub kl_mean: f64,
    pub perplexity: f64,
    pub hidden_cosine_mean: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub model: String,
    pub heavy_tail: bool,
    pub prompts: usize,
    pub positions: usize,
    pub float_perplexity: f64,
    pub rows: Vec<Row>,
}

/// Float's figures at one position, kept for every scheme's comparison.
struct FloatAt {
    logits: Vec<f32>,
    /// log Σ exp(logits), f64.
    lse: f64,
    hidden: Vec<f32>,
}

/// One scheme's figures at one position against float.
#[derive(Clone, Copy, Default)]
struct At {
    agree: bool,
    kl: f64,
    cos: f64,
    /// −log p(next token), when there is one.
    nll: Option<f64>,
}

fn lse(v: &[f32]) -> f64 {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m
}

/// Every position of every sequence through `b` (teacher-forced decode steps, continuous batching: `batch`
/// positions per chained run of the decode graph, a finished sequence's place taken by the next), logits by
/// the batched head; `each(seq, pos, hidden, logits)` in parallel as rows come out. Each position's values
/// are what one sequence alone gives (`step_chain` and [`hexq_runtime::graph::Head`] are exact per row).
fn teacher_forced(
    b: &mut hexq_runtime::graph::GraphBackend,
    head: &hexq_runtime::graph::Head,
    seqs: &[Vec<u32>],
    batch: usize,
    pb: &indicatif::ProgressBar,
    each: &(dyn Fn(usize, usize, &[f32], &[f32]) + Sync),
) -> hexq_model::Result<()> {
    use rayon::prelude::*;
    // (sequence, next position, slot)
    let mut jobs: Vec<(usize, usize, hexq_runtime::graph::Slot)> = Vec::new();
    let mut next = 0;
    loop {
        while jobs.len() < batch && next < seqs.len() {
            if !seqs[next].is_empty() {
                jobs.push((next, 0, b.new_slot()));
            }
            next += 1;
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let mut take = vec![1usize; jobs.len()];
        let left: Vec<usize> = jobs.iter().map(|j| seqs[j.0].len() - j.1).collect();
        hexq_runtime::graph::spread(&mut take, &left, batch.saturating_sub(jobs.len()));
        let runs: Vec<&[u32]> = jobs
            .iter()
            .zip(&take)
            .map(|(j, &t)| &seqs[j.0][j.1..j.1 + t])
            .collect();
        let mut slots: Vec<&mut hexq_runtime::graph::Slot> =
            jobs.iter_mut().map(|j| &mut j.2).collect();
        let hs = b.step_chain(&mut slots, &runs)?;
        // (sequence, position, hidden) per row, in order.
        let rows: Vec<(usize, usize, &[f32])> = jobs
            .iter()
            .zip(&hs)
            .flat_map(|(j, h)| {
                h.iter()
                    .enumerate()
                    .map(move |(k, h)| (j.0, j.1 + k, h.as_slice()))
            })
            .collect();
        let hrefs: Vec<&[f32]> = rows.iter().map(|r| r.2).collect();
        let ls = head.logits(&hrefs);
        rows.par_iter()
            .zip(ls.par_iter())
            .for_each(|(&(s, p, h), l)| each(s, p, h, l));
        pb.inc(rows.len() as u64);
        for (j, t) in jobs.iter_mut().zip(&take) {
            j.1 += t;
        }
        jobs.retain(|j| j.1 < seqs[j.0].len());
    }
}

/// Run every scheme over the token sequences (teacher-forced, all positions) against float: one batched
/// pass of the decode graph for float (its logits kept), then one per scheme scored on the fly.
#[allow(clippy::too_many_arguments)]
pub fn ablate(
    ck: &Arc<hexq_model::Checkpoint>,
    seqs: &[Vec<u32>],
    cells: &[Cell],
    builds: &[Build],
    heavy_tail: bool,
    inputs: Option<&Inputs>,
    o: &hexq_graph::GraphOptions,
    batch: usize,
    pb: &indicatif::ProgressBar,
) -> hexq_model::Result<Report> {
    if heavy_tail && !builds.is_empty() {
        return Err(hexq_model::Error::Usage(
            "--heavy-tail changes the weights; an encodings file describes the checkpoint's own (drop one)"
                .into(),
        ));
    }
    if heavy_tail
        && cells
            .iter()
            .any(|c| c.rounding != Rounding::Rtn || c.head != Head::Float)
    {
        return Err(hexq_model::Error::Usage(
            "--heavy-tail rescales the decoder inside the graph; a calibration-aware rounding or a quantized head reads the checkpoint's own weights (drop one)"
                .into(),
        ));
    }
    // Rings as long as the sequences reach (the same figures; see `build::spanning`), hooks under the full
    // graph's names.
    let reach = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
    let span = hexq_graph::build::spanning(&ck.config, Variant::DecodeWgqa, o, reach);
    let pass = Pass {
        ck,
        seqs,
        heavy_tail,
        batch: batch.max(1),
        pb,
        go: span.as_ref().map_or(*o, |s| s.options),
        names: Arc::new(
            span.map(|s| s.tensors.into_iter().map(|(k, v)| (k, v.0)).collect())
                .unwrap_or_default(),
        ),
        head: hexq_runtime::graph::Head::of(ck)?,
        clock: std::time::Instant::now(),
    };
    let positions: usize = seqs.iter().map(|s| s.len()).sum();
    pb.set_length(((cells.len() + builds.len() + 1) * positions) as u64);
    let float = pass.float()?;
    let (pass, float) = (&pass, &float);
    let float_perplexity = ppl(&mut seqs.iter().enumerate().flat_map(|(s, ids)| {
        (0..ids.len())
            .filter_map(move |p| pass.next_nll(s, p, &float[s][p].logits, float[s][p].lse))
    }));
    let mut rows = Vec::new();
    // A (grid, rounding)'s weights, kept for the next cells that differ only in the head.
    let mut last: Option<(&Cell, Arc<Rounded>)> = None;
    for cell in cells {
        let rounded = match cell.rounding {
            Rounding::Rtn => None,
            r => match &last {
                Some((c, v)) if c.scheme.name == cell.scheme.name && c.rounding == r => {
                    Some(v.clone())
                }
                _ => {
                    let inp = inputs.ok_or_else(|| {
                        hexq_model::Error::Usage(format!(
                            "rounding {} needs the calibration inputs",
                            r.name()
                        ))
                    })?;
                    let (v, sums) = rounded::round_decoder(ck, &cell.scheme, r, inp, &|t| {
                        pb.set_message(format!("{} {}: {t}", cell.scheme.name, r.name()))
                    })?;
                    pass.lap(&format!("{} {}", cell.scheme.name, r.name()));
                    let v = Arc::new(Rounded { values: v, sums });
                    last = Some((cell, v.clone()));
                    Some(v)
                }
            },
        };
        rows.push(pass.row(&Cand::Cell { cell, rounded }, float)?);
    }
    for bd in builds {
        rows.push(pass.row(&Cand::Build(bd), float)?);
    }
    Ok(Report {
        model: hexq_fsutil::dir_name(&ck.dir),
        heavy_tail,
        prompts: seqs.len(),
        positions,
        float_perplexity,
        rows,
    })
}

/// One row's source: a weights-only cell (with its rounded weights unless rounded to nearest) or a build.
enum Cand<'a> {
    Cell {
        cell: &'a Cell,
        rounded: Option<Arc<Rounded>>,
    },
    Build(&'a Build),
}

/// A (grid, rounding)'s decoder weights and their error sums per class.
struct Rounded {
    values: BTreeMap<String, Vec<f32>>,
    sums: ClassSums,
}

/// Perplexity of a stream of −log p.
fn ppl(nll: &mut dyn Iterator<Item = f64>) -> f64 {
    let (mut sum, mut n) = (0f64, 0usize);
    for x in nll {
        sum += x;
        n += 1;
    }
    (sum / n.max(1) as f64).exp()
}

/// What every pass of one ablation shares: the sequences, the (short-ring) graph options and the names that
/// map its tensors to the full graph's, the head.
struct Pass<'a> {
    ck: &'a Arc<hexq_model::Checkpoint>,
    seqs: &'a [Vec<u32>],
    heavy_tail: bool,
    batch: usize,
    pb: &'a indicatif::ProgressBar,
    go: hexq_graph::GraphOptions,
    names: Arc<std::collections::HashMap<String, String>>,
    head: hexq_runtime::graph::Head,
    clock: std::time::Instant,
}

impl Pass<'_> {
    /// Under HEXQ_PROFILE, when each phase ends.
    fn lap(&self, what: &str) {
        if std::env::var_os("HEXQ_PROFILE").is_some() {
            let t = self.clock.elapsed().as_secs_f64();
            eprintln!("ablate: {what} done at {t:.1} s");
        }
    }

    /// −log p of the token after position `p` of sequence `s`, when there is one.
    fn next_nll(&self, s: usize, p: usize, l: &[f32], z: f64) -> Option<f64> {
        self.seqs[s].get(p + 1).map(|&t| z - l[t as usize] as f64)
    }

    /// The decode graph on `ck`, with `scheme`'s grid (and/or the heavy tail) baked in.
    fn backend(
        &self,
        ck: &Arc<hexq_model::Checkpoint>,
        scheme: Option<Scheme>,
    ) -> hexq_model::Result<(GraphBackend, Sqnr)> {
        let sqnr: Sqnr = Default::default();
        let mut b = GraphBackend::for_model(ck, Variant::DecodeWgqa, false, &self.go)?;
        self.lap("load");
        if scheme.is_some() || self.heavy_tail {
            b.bake(&mut hexq_graph::interp::Renamed {
                inner: Box::new(GridHook {
                    scheme,
                    heavy_tail: self.heavy_tail,
                    sqnr: sqnr.clone(),
                }),
                names: self.names.clone(),
            })?;
            self.lap("bake");
        }
        Ok((b, sqnr))
    }

    /// The decode graph as a build runs it: its params baked, its activations fake-quantized as produced.
    fn build_backend(&self, bd: &Build) -> hexq_model::Result<(GraphBackend, Sqnr)> {
        let sqnr: Sqnr = Default::default();
        let ck = bd.weights.as_ref().unwrap_or(self.ck);
        let mut b = GraphBackend::for_model(ck, Variant::DecodeWgqa, false, &self.go)?;
        self.lap("load");
        b.bake(&mut hexq_graph::interp::Renamed {
            inner: Box::new(Measured {
                inner: FakeQuant::params_of(&bd.enc),
                sqnr: sqnr.clone(),
            }),
            names: self.names.clone(),
        })?;
        let acts = FakeQuant::activations(&bd.enc).on_grid(&b.decode.graph, &self.names);
        b.hook = Some(Box::new(hexq_graph::interp::Renamed {
            inner: Box::new(acts),
            names: self.names.clone(),
        }));
        self.lap("bake");
        Ok((b, sqnr))
    }

    /// Float: logits, log-sum-exp and hidden state at every position.
    fn float(&self) -> hexq_model::Result<Vec<Vec<FloatAt>>> {
        let slots: Vec<Vec<Mutex<Option<FloatAt>>>> = self
            .seqs
            .iter()
            .map(|s| s.iter().map(|_| Mutex::new(None)).collect())
            .collect();
        {
            let (mut b, _) = self.backend(self.ck, None)?;
            teacher_forced(
                &mut b,
                &self.head,
                self.seqs,
                self.batch,
                self.pb,
                &|s, p, h, l| {
                    *slots[s][p].lock().unwrap() = Some(FloatAt {
                        logits: l.to_vec(),
                        lse: lse(l),
                        hidden: h.to_vec(),
                    });
                },
            )?;
        }
        self.lap("float pass");
        Ok(slots
            .into_iter()
            .map(|v| {
                v.into_iter()
                    .map(|m| m.into_inner().unwrap().unwrap())
                    .collect()
            })
            .collect())
    }

    /// A cell's decode graph and head: to nearest, the grid baked in as the pass reads the checkpoint;
    /// rounded, the rounded weights overlaid and nothing baked; a quantized head overlaid on the
    /// embedding table (lookup and logits both read it, as a tied GGUF's token_embd). Also the embedding
    /// table's error sums when it is quantized.
    #[allow(clippy::type_complexity)]
    fn cell_backend(
        &self,
        cell: &Cell,
        rounded: Option<&Rounded>,
    ) -> hexq_model::Result<(
        GraphBackend,
        Sqnr,
        Option<hexq_runtime::graph::Head>,
        Option<(f64, f64)>,
    )> {
        let head = rounded::head_values(self.ck, cell.scheme.grid, cell.head)?;
        let ck = match (rounded, &head) {
            (None, None) => self.ck.clone(),
            _ => {
                let mut q = hexq_model::Checkpoint::open(&self.ck.dir)?;
                if let Some(r) = rounded {
                    q.overlay_values(&r.values)?;
                }
                if let Some((h, _)) = &head {
                    q.overlay_values(h)?;
                }
                Arc::new(q)
            }
        };
        let (b, sq) = match rounded {
            None => self.backend(&ck, Some(cell.scheme.clone()))?,
            Some(r) => {
                let (b, sq) = self.backend(&ck, None)?;
                *sq.lock().unwrap() = r.sums.clone();
                (b, sq)
            }
        };
        let rows = match head {
            Some(_) => Some(hexq_runtime::graph::Head::of(&ck)?),
            None => None,
        };
        Ok((b, sq, rows, head.map(|h| h.1)))
    }

    /// One candidate's pass scored against float at every position, and its row.
    fn row(&self, cand: &Cand, float: &[Vec<FloatAt>]) -> hexq_model::Result<Row> {
        let (name, (mut b, sq), head, head_sums) = match cand {
            Cand::Cell { cell, rounded } => {
                let (b, sq, h, hs) = self.cell_backend(cell, rounded.as_deref())?;
                (&cell.scheme.name, (b, sq), h, hs)
            }
            Cand::Build(bd) => (&bd.name, self.build_backend(bd)?, None, None),
        };
        let at: Vec<Vec<Mutex<At>>> = self
            .seqs
            .iter()
            .map(|s| s.iter().map(|_| Mutex::new(At::default())).collect())
            .collect();
        teacher_forced(
            &mut b,
            head.as_ref().unwrap_or(&self.head),
            self.seqs,
            self.batch,
            self.pb,
            &|s, p, h, l| {
                let f = &float[s][p];
                let zq = lse(l);
                let kl = f
                    .logits
                    .iter()
                    .zip(l)
                    .map(|(&a, &b)| {
                        let la = a as f64 - f.lse;
                        la.exp() * (la - (b as f64 - zq))
                    })
                    .sum::<f64>();
                *at[s][p].lock().unwrap() = At {
                    agree: hexq_model::forward::argmax(&f.logits) == hexq_model::forward::argmax(l),
                    kl,
                    cos: cos(&f.hidden, h),
                    nll: self.next_nll(s, p, l, zq),
                };
            },
        )?;
        drop((b, head));
        self.lap(name);
        let at: Vec<At> = at
            .into_iter()
            .flatten()
            .map(|m| m.into_inner().unwrap())
            .collect();
        let n = at.len().max(1) as f64;
        let mut sqnr: BTreeMap<String, f64> = sq
            .lock()
            .unwrap()
            .iter()
            .map(|(k, (s, n, _))| (k.to_string(), sqnr_db(*s, *n)))
            .collect();
        // A grid also on the (host-side) embedding table, for its SQNR; a build keeps it in float.
        // A float head: the embedding table's SQNR on the grid all the same (what it would cost); a build
        // keeps it in float.
        let (bits_per_weight, decoder_mib, activations, rounding, head) = match cand {
            Cand::Cell { cell, .. } => {
                let sc = &cell.scheme;
                let e = match head_sums {
                    Some((s, n)) => sqnr_db(s, n),
                    None => embedding_sqnr(self.ck, sc.grid)?,
                };
                sqnr.insert("embeddings".into(), e);
                self.lap("embedding SQNR");
                let (b, m) = accounting(self.ck, |spec| {
                    (!(sc.mlp_only && spec.role != Role::Mlp)).then(|| sc.bpw(spec.shape[1]))
                });
                let r = cell.rounding.name().to_string();
                (b, m, "float".to_string(), r, cell.head.name(sc.grid))
            }
            Cand::Build(bd) => {
                let (b, m) = accounting(self.ck, |spec| build_bpw(&bd.enc, spec));
                let r = bd.enc.hexq["rounding"]["method"].as_str().unwrap_or("rtn");
                (b, m, bd.activations(), r.to_string(), "float".to_string())
            }
        };
        Ok(Row {
            scheme: name.clone(),
            rounding,
            head,
            activations,
            bits_per_weight,
            decoder_mib,
            sqnr_db: sqnr,
            top1_agreement: at.iter().filter(|a| a.agree).count() as f64 / n,
            kl_mean: at.iter().map(|a| a.kl).sum::<f64>() / n,
            perplexity: ppl(&mut at.iter().filter_map(|a| a.nll)),
            hidden_cosine_mean: at.iter().map(|a| a.cos).sum::<f64>() / n,
        })
    }
}

/// Embeddings (host-side tables; SQNR only — the accuracy columns quantize the decoder), in row blocks so
/// an E2B table never sits in f32 whole.
fn embedding_sqnr(ck: &hexq_model::Checkpoint, grid: Grid) -> hexq_model::Result<f64> {
    use hexq_graph::interp::WeightSource;
    use rayon::prelude::*;
    let e = ck.rows(hexq_model::names::EMBED)?;
    let grid = resolve(grid, e.inp);
    // Per-row sums collected, then added in row order: rayon's reduce tree follows its work splitting, which
    // moved the last digits from run to run.
    let per: Vec<(f64, f64)> = (0..e.out)
        .into_par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |(buf, row), j| {
                row.clear();
                row.extend_from_slice(e.row(j, buf));
                row_grid(grid, row);
                err_sums(e.row(j, buf), row)
            },
        )
        .collect();
    let (s, n) = per.iter().fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    Ok(sqnr_db(s, n))
}

/// (bits per quantized weight, decoder MiB) from the tensor table: 2-D weights at `bpw`'s bits/weight when
/// it quantizes them, the rest bf16; host-side vocab tables excluded.
fn accounting(
    ck: &hexq_model::Checkpoint,
    bpw: impl Fn(&hexq_model::names::TensorSpec) -> Option<f64>,
) -> (f64, f64) {
    let (mut bits, mut params, mut bytes) = (0f64, 0f64, 0f64);
    for (spec, _) in &ck.tensors {
        if spec.role.is_vocab() {
            continue;
        }
        let n = spec.numel() as f64;
        if let Some(b) = (spec.shape.len() == 2).then(|| bpw(spec)).flatten() {
            bits += b * n;
            params += n;
            bytes += b * n / 8.0;
        } else {
            bytes += 2.0 * n;
        }
    }
    (bits / params.max(1.0), bytes / (1u64 << 20) as f64)
}

/// A MatMul weight's bits/weight under an encodings file: LPBQ (int4 + the block's scale in 8 bits + an f32 per
/// channel), per-channel or per-tensor (bits + an f32 per channel); None when the file leaves it float.
fn build_bpw(enc: &hexq_quantize::Encodings, spec: &hexq_model::names::TensorSpec) -> Option<f64> {
    let name = format!("{}.T", spec.name);
    let n = spec.numel() as f64;
    if let Some(l) = enc.lpbq_encodings.get(&name) {
        // The block's scale integer (bw − compressed_bw = 4 bits) sits in an 8-bit container, as in the
        // exported uint8 DequantizeLinear chain and [`Scheme::bpw`].
        return Some(
            l.compressed_bw as f64 + 8.0 / l.block_size as f64 + 32.0 * l.scale.len() as f64 / n,
        );
    }
    let e = enc.param_encodings.get(&name)?;
    Some(e.first()?.bitwidth as f64 + 32.0 * e.len() as f64 / n)
}
