//! llama-perplexity's protocol and statistics, so that hexq's figures sit beside a GGUF user's
//! (`tools/perplexity/perplexity.cpp` of the llama.cpp CI builds, 0.3.36's tree):
//!
//! - the text tokenized once with BOS; `n_chunk = tokens / ctx` chunks of `ctx` tokens, each evaluated from
//!   an empty cache with its first token replaced by BOS; the logits at positions `ctx/2 .. ctx−2` scored
//!   against the next token ([`chunks`], [`first`]);
//! - PPL = exp(mean NLL), its error `ppl · sqrt((E[nll²] − E[nll]²)/(count − 1))` ([`Ppl`]);
//! - `--kl-divergence-base` files: `_logits_`, n_ctx (u32), n_vocab, n_chunk (i32), the tokens, then per
//!   scored position `2·⌈n_vocab/2⌉ + 4` u16 — scale and min log-prob as two f32, then each logit's
//!   log-prob quantized to 16 bits over the top 16 nats ([`base_row`], [`BaseWriter`], [`BaseReader`]); read
//!   and written byte for byte as llama-perplexity does, so either tool's base serves the other;
//! - KLD, same-top and Δp statistics with llama's arithmetic, f32 where it is f32 ([`Kld`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// A perplexity run's error: the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    #[error("{0}")]
    Input(String),
}

fn ferr(p: &Path, msg: impl Into<String>) -> Error {
    Error::File {
        path: p.to_path_buf(),
        msg: msg.into(),
    }
}

/// The first scored position of a chunk of `ctx`.
pub fn first(ctx: usize) -> usize {
    ctx / 2
}

/// Scored positions per chunk.
pub fn scored(ctx: usize) -> usize {
    ctx - 1 - first(ctx)
}

/// The chunks of `tokens` (the text with its BOS): `len / ctx` of them (at most `max`), each `ctx` long.
/// The BOS replacement of each chunk's first token is the caller's feed (`with_bos`).
pub fn chunks(tokens: &[u32], ctx: usize, max: Option<usize>) -> Result<Vec<&[u32]>, Error> {
    if ctx < 4 {
        return Err(Error::Input(format!("--ctx {ctx}: at least 4 tokens")));
    }
    if tokens.len() < 2 * ctx {
        return Err(Error::Input(format!(
            "you need at least {} tokens to evaluate perplexity with a context of {ctx}; the text tokenizes \
             to only {}",
            2 * ctx,
            tokens.len()
        )));
    }
    let n = (tokens.len() / ctx).min(max.unwrap_or(usize::MAX));
    Ok((0..n).map(|i| &tokens[i * ctx..(i + 1) * ctx]).collect())
}

/// A chunk as it is fed: its first token replaced by BOS.
pub fn with_bos(chunk: &[u32], bos: u32) -> Vec<u32> {
    let mut v = chunk.to_vec();
    v[0] = bos;
    v
}

/// llama's max and Σ exp(l − max): f32 max, `expf` of f32 differences summed in f64, in vocabulary order.
fn max_sum(logits: &[f32]) -> (f32, f64) {
    let m = logits.iter().copied().fold(logits[0], f32::max);
    let s: f64 = logits.iter().map(|&l| (l - m).exp() as f64).sum();
    (m, s)
}

/// Σ nll, Σ nll² and the count: llama-perplexity's running sums.
#[derive(Debug, Default, Clone)]
pub struct Ppl {
    pub nll: f64,
    pub nll2: f64,
    pub count: usize,
}

impl Ppl {
    /// One scored position, as `log_softmax` without a logits file: `l_tok − max − ln Σ` (f32 − f32, then f64).
    pub fn add(&mut self, logits: &[f32], tok: u32) {
        let (m, s) = max_sum(logits);
        let v = -(((logits[tok as usize] - m) as f64) - s.ln());
        self.push(v);
    }
    fn push(&mut self, v: f64) {
        self.nll += v;
        self.nll2 += v * v;
        self.count += 1;
    }
    /// (PPL, its ± error) as "Final estimate: PPL = … +/- …".
    pub fn result(&self) -> (f64, f64) {
        let c = self.count as f64;
        let mean = self.nll / c;
        let var = self.nll2 / c - mean * mean;
        let ppl = mean.exp();
        let err = if var > 0.0 && self.count > 1 {
            (var / (c - 1.0)).sqrt() * ppl
        } else {
            0.0
        };
        (ppl, err)
    }
}

/// ggml's `nearest_int`: round half to even through the 1.5·2²³ trick.
fn nearest_int(v: f32) -> i32 {
    let x = (v + 12582912.0f32).to_bits() as i32;
    (x & 0x007f_ffff) - 0x0040_0000
}

/// u16 slots of one base row.
pub fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// One position's base row (`row_len(n_vocab)` u16, written in place) and its nll, as llama's
/// `log_softmax(n_vocab, logits, log_prob, tok)`.
pub fn base_row(logits: &[f32], tok: u32, out: &mut [u16]) -> f64 {
    let mut mx = logits[0];
    let mut mn = logits[0];
    for &l in &logits[1..] {
        mx = mx.max(l);
        mn = mn.min(l);
    }
    let mn = mn.max(mx - 16.0);
    let s: f64 = logits.iter().map(|&l| (l - mx).exp() as f64).sum();
    let lse = s.ln() as f32;
    let min_log_prob = mn - mx - lse;
    let scale = (mx - mn) / 65535.0f32;
    out[..2].copy_from_slice(bytemuck::cast_slice(&[scale.to_bits()]));
    out[2..4].copy_from_slice(bytemuck::cast_slice(&[min_log_prob.to_bits()]));
    let lp = &mut out[4..4 + logits.len()];
    if scale != 0.0 {
        let inv = 1.0 / scale;
        for (o, &l) in lp.iter_mut().zip(logits) {
            *o = if l > mn {
                nearest_int(inv * (l - mn)) as u16
            } else {
                0
            };
        }
    } else {
        lp.iter_mut().for_each(|o| *o = 0);
    }
    out[4 + logits.len()..].iter_mut().for_each(|o| *o = 0);
    (mx + lse - logits[tok as usize]) as f64
}

/// A `--kl-divergence-base` file being written: the header and tokens first, then row by row.
pub struct BaseWriter {
    f: std::io::BufWriter<std::fs::File>,
    out: hexq_fsutil::AtomicFile,
    path: PathBuf,
    n_vocab: usize,
    row: Vec<u16>,
    pub ppl: Ppl,
}

impl BaseWriter {
    /// `tokens` = the first `n_chunk · ctx` tokens of the text (before the BOS replacement).
    pub fn create(
        path: &Path,
        ctx: usize,
        n_vocab: usize,
        n_chunk: usize,
        tokens: &[u32],
    ) -> Result<Self, Error> {
        let out = hexq_fsutil::AtomicFile::new(path);
        let io = |e: std::io::Error| ferr(path, e.to_string());
        let mut f = std::io::BufWriter::new(std::fs::File::create(&out.tmp).map_err(io)?);
        f.write_all(b"_logits_").map_err(io)?;
        f.write_all(&(ctx as u32).to_le_bytes()).map_err(io)?;
        f.write_all(&(n_vocab as i32).to_le_bytes()).map_err(io)?;
        f.write_all(&(n_chunk as i32).to_le_bytes()).map_err(io)?;
        for &t in &tokens[..n_chunk * ctx] {
            f.write_all(&(t as i32).to_le_bytes()).map_err(io)?;
        }
        Ok(BaseWriter {
            f,
            out,
            path: path.to_path_buf(),
            n_vocab,
            row: vec![0; row_len(n_vocab)],
            ppl: Ppl::default(),
        })
    }
    /// One scored position (its logits, the next token).
    pub fn add(&mut self, logits: &[f32], tok: u32) -> Result<(), Error> {
        if logits.len() != self.n_vocab {
            return Err(Error::Input(format!(
                "{} logits, the base has {}",
                logits.len(),
                self.n_vocab
            )));
        }
        let v = base_row(logits, tok, &mut self.row);
        self.ppl.push(v);
        self.f
            .write_all(bytemuck::cast_slice(&self.row))
            .map_err(|e| ferr(&self.path, e.to_string()))
    }
    pub fn finish(self) -> Result<Ppl, Error> {
        let io = |e: std::io::Error| ferr(&self.path, e.to_string());
        self.f
            .into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
        self.out
            .commit()
            .map_err(|e| ferr(&self.path, e.to_string()))?;
        Ok(self.ppl)
    }
}

/// A `--kl-divergence-base` file being read.
pub struct BaseReader {
    f: std::io::BufReader<std::fs::File>,
    path: PathBuf,
    pub ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    pub tokens: Vec<u32>,
    row: Vec<u16>,
}

impl BaseReader {
    pub fn open(path: &Path) -> Result<Self, Error> {
        let e = |m: &str| ferr(path, m);
        let mut f = std::io::BufReader::new(
            std::fs::File::open(path).map_err(|x| ferr(path, x.to_string()))?,
        );
        let mut head = [0u8; 20];
        f.read_exact(&mut head)
            .map_err(|_| e("shorter than a logits file's header"))?;
        if &head[..8] != b"_logits_" {
            return Err(e(
                "does not look like a file containing log-probabilities (no _logits_ magic)",
            ));
        }
        let u = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().unwrap());
        let (ctx, n_vocab, n_chunk) = (u(8) as usize, u(12) as i32, u(16) as i32);
        if ctx < 4 || n_vocab <= 0 || n_chunk <= 0 || ctx > 1 << 20 || n_chunk > 1 << 24 {
            return Err(e(&format!(
                "implausible header: n_ctx {ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}"
            )));
        }
        let (n_vocab, n_chunk) = (n_vocab as usize, n_chunk as usize);
        let want =
            20 + 4 * (ctx * n_chunk) as u64 + 2 * (row_len(n_vocab) * scored(ctx) * n_chunk) as u64;
        let have = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if have != want {
            return Err(e(&format!(
                "{have} bytes, its header (n_ctx {ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}) says {want}"
            )));
        }
        let mut tb = vec![0u8; 4 * ctx * n_chunk];
        f.read_exact(&mut tb).map_err(|_| e("short token list"))?;
        let tokens: Vec<u32> = tb
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .map(|t| u32::try_from(t).ok().filter(|&t| (t as usize) < n_vocab))
            .collect::<Option<_>>()
            .ok_or_else(|| e("a token id outside the vocabulary"))?;
        Ok(BaseReader {
            f,
            path: path.to_path_buf(),
            ctx,
            n_vocab,
            n_chunk,
            tokens,
            row: vec![0; row_len(n_vocab)],
        })
    }
    /// The next scored position's row.
    pub fn next_row(&mut self) -> Result<&[u16], Error> {
        let mut b = vec![0u8; 2 * self.row.len()];
        self.f
            .read_exact(&mut b)
            .map_err(|_| ferr(&self.path, "short log-prob rows"))?;
        for (r, c) in self.row.iter_mut().zip(b.chunks(2)) {
            *r = u16::from_le_bytes([c[0], c[1]]);
        }
        Ok(&self.row)
    }
}

/// llama-perplexity's `kl_divergence_result` and the per-position values it sorts.
#[derive(Debug, Default, Clone)]
pub struct Kld {
    sum_nll: f64,
    sum_nll2: f64,
    sum_nll_base: f64,
    sum_nll_base2: f64,
    sum_nll_nll_base: f64,
    sum_kld: f64,
    sum_kld2: f64,
    sum_p_diff: f64,
    sum_p_diff2: f64,
    sum_p_diff4: f64,
    max_p_diff: f32,
    n_same_top: usize,
    count: usize,
    kld_values: Vec<f32>,
    p_diff_values: Vec<f32>,
}

impl Kld {
    /// One scored position against its base row, with llama's arithmetic.
    pub fn add(&mut self, logits: &[f32], base: &[u16], tok: u32) {
        let (mut mx, mut imax) = (logits[0], 0usize);
        for (i, &l) in logits.iter().enumerate().skip(1) {
            if l > mx {
                mx = l;
                imax = i;
            }
        }
        let s: f64 = logits.iter().map(|&l| (l - mx).exp() as f64).sum();
        let lse = s.ln() as f32;
        let scale = f32::from_bits(u32::from_le_bytes(bytemuck::cast([base[0], base[1]])));
        let min_lp = f32::from_bits(u32::from_le_bytes(bytemuck::cast([base[2], base[3]])));
        let bl = &base[4..];
        let nll = mx + lse - logits[tok as usize];
        let nll_base = -(scale * bl[tok as usize] as f32 + min_lp);
        self.sum_nll += nll as f64;
        self.sum_nll2 += (nll * nll) as f64;
        self.sum_nll_base += nll_base as f64;
        self.sum_nll_base2 += (nll_base * nll_base) as f64;
        self.sum_nll_nll_base += (nll * nll_base) as f64;
        let top = mx + lse;
        let (mut sum, mut imax_base, mut pmax) = (0f64, 0usize, 0f32);
        for (i, &l) in logits.iter().enumerate() {
            let pb = scale * bl[i] as f32 + min_lp;
            if i == 0 || pb > pmax {
                pmax = pb;
                imax_base = i;
            }
            if pb > -16.0 {
                sum += (pb.exp() * (pb - l + top)) as f64;
            }
        }
        self.sum_kld += sum;
        self.sum_kld2 += sum * sum;
        self.count += 1;
        self.n_same_top += (imax == imax_base) as usize;
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.sum_p_diff += p_diff as f64;
        let d2 = (p_diff * p_diff) as f64;
        self.sum_p_diff2 += d2;
        self.sum_p_diff4 += d2 * d2;
        self.max_p_diff = self.max_p_diff.max(p_diff.abs());
        self.kld_values.push(sum as f32);
        self.p_diff_values.push(p_diff);
    }

    /// The statistics llama-perplexity prints, by its formulas: (JSON keys as hexq reports them).
    pub fn report(&self) -> serde_json::Value {
        let mu = |s: f64, s2: f64| {
            let c = self.count as f64;
            let f = s / c;
            let df = s2 / c - f * f;
            let df = if df > 0.0 && self.count > 10 {
                (df / (c - 1.0)).sqrt()
            } else {
                0.0
            };
            (f, df)
        };
        let (lp, lpe) = mu(self.sum_nll, self.sum_nll2);
        let (lb, lbe) = mu(self.sum_nll_base, self.sum_nll_base2);
        let (kl, kle) = mu(self.sum_kld, self.sum_kld2);
        let (msq, msqe) = mu(self.sum_p_diff2, self.sum_p_diff4);
        let rms = msq.sqrt();
        let mut v = self.kld_values.clone();
        v.sort_by(f32::total_cmp);
        let median = match v.len() % 2 {
            0 => 0.5 * (v[v.len() / 2] + v[v.len() / 2 - 1]),
            _ => v[v.len() / 2],
        };
        let pct = |fr: f32| {
            let p = fr * (v.len() - 1) as f32;
            let ip = p as usize;
            let p = p - ip as f32;
            (1.0 - p) * v[ip] + p * v[(ip + 1).min(v.len() - 1)]
        };
        let top = self.n_same_top as f64 / self.count as f64;
        serde_json::json!({
            "ppl": lp.exp(), "ppl_err": lp.exp() * lpe,
            "ppl_base": lb.exp(), "ppl_base_err": lb.exp() * lbe,
            "kld_mean": kl, "kld_err": kle, "kld_median": median, "kld_p99": pct(0.99),
            "kld_p999": pct(0.999), "kld_max": v[v.len() - 1],
            "same_top": top, "same_top_err": (top * (1.0 - top) / (self.count as f64 - 1.0)).sqrt(),
            "rms_dp": rms, "rms_dp_err": 0.5 / rms * msqe,
            "max_dp": self.max_p_diff, "count": self.count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_is_ggmls() {
        for (x, want) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (65534.6, 65535),
            (3.49, 3),
        ] {
            assert_eq!(nearest_int(x), want, "{x}");
        }
    }

    #[test]
    fn a_base_row_round_trips_its_own_kl_as_zero() {
        let logits: Vec<f32> = (0..101)
            .map(|i| ((i * 37 % 101) as f32 / 9.0).sin() * 6.0)
            .collect();
        let mut row = vec![0u16; row_len(logits.len())];
        let nll = base_row(&logits, 7, &mut row);
        let mut p = Ppl::default();
        p.add(&logits, 7);
        assert!((nll - p.nll).abs() < 1e-5);
        let mut k = Kld::default();
        k.add(&logits, &row, 7);
        let r = k.report();
        assert!(r["kld_mean"].as_f64().unwrap().abs() < 1e-4, "{r}");
        assert_eq!(r["same_top"], 1.0);
    }

    #[test]
    fn chunks_follow_llama_perplexity() {
        let t: Vec<u32> = (0..1000).collect();
        let c = chunks(&t, 256, None).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c[1][0], 256);
        assert_eq!(with_bos(c[1], 2)[0], 2);
        assert_eq!(chunks(&t, 256, Some(2)).unwrap().len(), 2);
        assert!(chunks(&t[..500], 256, None).is_err());
        assert_eq!((first(256), scored(256)), (128, 127));
    }
}
