//! Sampling beside greedy, in llama.cpp's default order (`common/sampling.cpp`): repetition penalty over the
//! last `repeat_last_n` tokens, then top-k, top-p, min-p on the untempered distribution, then temperature
//! and a draw. Temperature 0 is greedy (argmax after the penalty), as llama.cpp's `temp <= 0`. The draw uses
//! a seeded splitmix64 of our own, so a seed gives the same stream on every platform and every backend that
//! produces the same logits.

use hexq_model::forward::argmax;

#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than min_p × the most likely one (0 = off).
    pub min_p: f32,
    /// llama.cpp's repetition penalty on the last `repeat_last_n` ids: logit / r if positive, × r if not (1 = off).
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Refuse values no sampler can mean (named by the CLI flag).
    pub fn check(&self) -> Result<(), String> {
        let bad = |f: &str, v: f32| Err(format!("--{f} {v}"));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top-p", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p", self.min_p);
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return bad("repeat-penalty", self.repeat_penalty);
        }
        Ok(())
    }
}

pub struct Sampler {
    pub cfg: Sampling,
    state: u64,
}

impl Sampler {
    pub fn new(cfg: Sampling) -> Self {
        let state = cfg.seed;
        Sampler { cfg, state }
    }

    /// splitmix64 → a uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token from `logits`, `history` being every id so far (prompt and generated).
    pub fn next(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let c = &self.cfg;
        let mut l = logits.to_vec();
        if c.repeat_penalty != 1.0 && c.repeat_last_n > 0 {
            let mut seen = std::collections::HashSet::new();
            for &t in history.iter().rev().take(c.repeat_last_n) {
                if seen.insert(t) {
                    if let Some(x) = l.get_mut(t as usize) {
                        *x = if *x > 0.0 {
                            *x / c.repeat_penalty
                        } else {
                            *x * c.repeat_penalty
                        };
                    }
                }
            }
        }
        if c.temperature <= 0.0 {
            return argmax(&l);
        }
        // Candidates by descending logit (ties by id, as a stable sort gives).
        let mut cand: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if c.top_k > 0 {
            cand.truncate(c.top_k.max(1));
        }
        let probs = |cand: &[(u32, f32)], t: f32| -> Vec<f64> {
            let m = cand[0].1 as f64;
            let e: Vec<f64> = cand
                .iter()
                .map(|&(_, x)| ((x as f64 - m) / t as f64).exp())
                .collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|v| v / s).collect()
        };
        if c.top_p < 1.0 {
            let p = probs(&cand, 1.0);
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, q) in p.iter().enumerate() {
                acc += q;
                if acc >= c.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if c.min_p > 0.0 {
            // p_i ≥ min_p · p_max  ⇔  l_i ≥ l_max + ln(min_p).
            let floor = cand[0].1 as f64 + (c.min_p as f64).ln();
            cand.retain(|&(_, x)| x as f64 >= floor);
        }
        let p = probs(&cand, c.temperature);
        let u = self.uniform();
        let mut acc = 0.0;
        for (i, q) in p.iter().enumerate() {
            acc += q;
            if u < acc {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_at_temperature_zero_and_deterministic_for_a_seed() {
        let l = [0.1, 2.0, 1.9, -1.0];
        let mut g = Sampler::new(Sampling::default());
        assert_eq!(g.next(&l, &[]), 1);
        // The penalty can flip greedy: 2.0 / 1.1 < 1.9.
        let mut g = Sampler::new(Sampling {
            repeat_penalty: 1.1,
            ..Default::default()
        });
        assert_eq!(g.next(&l, &[1]), 2);
        let cfg = Sampling {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..50).map(|_| s.next(&l, &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..50).map(|_| s.next(&l, &[])).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != 1),
            "temperature 1 draws more than the argmax: {a:?}"
        );
        // top-k 1 and min-p 1 are greedy whatever the temperature.
        let mut s = Sampler::new(Sampling {
            temperature: 5.0,
            top_k: 1,
            ..cfg.clone()
        });
        assert!((0..20).all(|_| s.next(&l, &[]) == 1));
        let mut s = Sampler::new(Sampling {
            temperature: 5.0,
            min_p: 1.0,
            ..cfg.clone()
        });
        assert!((0..20).all(|_| s.next(&l, &[]) == 1));
        // top-p 0.5 keeps {1} only when p(1) ≥ 0.5: softmax([0.1, 2, 1.9, -1]) has p(1) ≈ 0.48, so {1, 2}.
        let mut s = Sampler::new(Sampling {
            temperature: 1.0,
            top_p: 0.5,
            ..cfg
        });
        let got: std::collections::BTreeSet<u32> = (0..200).map(|_| s.next(&l, &[])).collect();
        assert_eq!(got.into_iter().collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn frequencies_follow_the_tempered_softmax() {
        let l = [0.0f32, 1.0, 2.0];
        let mut s = Sampler::new(Sampling {
            temperature: 0.5,
            seed: 3,
            ..Default::default()
        });
        let n = 20000;
        let mut c = [0usize; 3];
        for _ in 0..n {
            c[s.next(&l, &[]) as usize] += 1;
        }
        let z: f64 = [0.0f64, 2.0, 4.0].iter().map(|x| x.exp()).sum();
        for (i, x) in [0.0f64, 2.0, 4.0].iter().enumerate() {
            let want = x.exp() / z;
            let got = c[i] as f64 / n as f64;
            assert!((got - want).abs() < 0.015, "token {i}: {got} vs {want}");
        }
    }
}
