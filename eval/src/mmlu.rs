//! Multiple choice the published card's way: 0-shot, chat-formatted, one forward pass per question, the
//! answer read from the logits of the four letter tokens at the model turn's first position. Accuracy with a
//! bootstrap standard error, per subject, and per-question agreement between two runs (the card's "the two
//! models disagree on ~24 % of individual questions").
//!
//! Data: the MMLU release's CSV layout (`question, A, B, C, D, answer`, no header; the subject from the file
//! name, `<subject>_test.csv`), or JSONL `{"question", "choices": [4], "answer": "A".."D" | 0..3,
//! "subject"?}`.

use std::collections::BTreeMap;
use std::path::Path;

pub const LETTERS: [&str; 4] = ["A", "B", "C", "D"];

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Question {
    pub subject: String,
    pub question: String,
    pub choices: [String; 4],
    /// 0..3.
    pub answer: usize,
}

fn bad(p: &Path, line: usize, msg: impl std::fmt::Display) -> String {
    format!("{}: line {line}: {msg}", p.display())
}

fn letter(s: &str) -> Option<usize> {
    LETTERS
        .iter()
        .position(|l| l.eq_ignore_ascii_case(s.trim()))
}

/// The questions of a CSV (MMLU layout) or JSONL file; every error names the file and line.
pub fn load(p: &Path) -> Result<Vec<Question>, String> {
    let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let jsonl = p.extension().is_some_and(|e| e == "jsonl" || e == "json");
    let out = if jsonl {
        jsonl_questions(p, &text)?
    } else {
        csv_questions(p, &text)?
    };
    if out.is_empty() {
        return Err(format!("{}: no questions", p.display()));
    }
    Ok(out)
}

fn csv_questions(p: &Path, text: &str) -> Result<Vec<Question>, String> {
    let stem = p
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    let subject = ["_test", "_dev", "_val"]
        .iter()
        .find_map(|s| stem.strip_suffix(s))
        .unwrap_or(&stem)
        .to_string();
    let mut r = csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(text.as_bytes());
    let mut out = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let rec = rec.map_err(|e| bad(p, i + 1, e))?;
        if rec.len() != 6 {
            return Err(bad(
                p,
                i + 1,
                format!("{} fields, the MMLU layout has 6", rec.len()),
            ));
        }
        let answer = letter(&rec[5])
            .ok_or_else(|| bad(p, i + 1, format!("answer {:?} is not A–D", &rec[5])))?;
        out.push(Question {
            subject: subject.clone(),
            question: rec[0].to_string(),
            choices: [1, 2, 3, 4].map(|k| rec[k].to_string()),
            answer,
        });
    }
    Ok(out)
}

fn jsonl_questions(p: &Path, text: &str) -> Result<Vec<Question>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(p, i + 1, e))?;
        let q = v["question"]
            .as_str()
            .ok_or_else(|| bad(p, i + 1, "no \"question\""))?;
        let ch: Vec<String> = v["choices"]
            .as_array()
            .filter(|c| c.len() == 4)
            .and_then(|c| c.iter().map(|x| x.as_str().map(String::from)).collect())
            .ok_or_else(|| bad(p, i + 1, "\"choices\" must be 4 strings"))?;
        let answer = match &v["answer"] {
            serde_json::Value::String(s) => letter(s),
            serde_json::Value::Number(n) => n.as_u64().filter(|&n| n < 4).map(|n| n as usize),
            _ => None,
        }
        .ok_or_else(|| bad(p, i + 1, "\"answer\" must be A–D or 0–3"))?;
        out.push(Question {
            subject: v["subject"].as_str().unwrap_or("all").to_string(),
            question: q.to_string(),
            choices: ch.try_into().unwrap(),
            answer,
        });
    }
    Ok(out)
}

/// The user turn of a question (the chat template wraps it; the model turn opens after it).
pub fn prompt(q: &Question) -> String {
    let subject = q.subject.replace('_', " ");
    let mut s = format!(
        "The following is a multiple choice question about {subject}. Answer with the letter of the \
         correct option only.\n\n{}\n",
        q.question.trim()
    );
    for (l, c) in LETTERS.iter().zip(&q.choices) {
        s += &format!("{l}. {}\n", c.trim());
    }
    s + "Answer:"
}

/// The chosen letter: the largest of the four letter tokens' logits (ties to the first).
pub fn choose(logits: &[f32], letter_ids: &[u32; 4]) -> usize {
    let mut best = 0;
    for k in 1..4 {
        if logits[letter_ids[k] as usize] > logits[letter_ids[best] as usize] {
            best = k;
        }
    }
    best
}

/// Questions whose text is in the calibration set (a message containing it, or equal to it).
pub fn overlap(qs: &[Question], calibration: &[String]) -> Vec<usize> {
    qs.iter()
        .enumerate()
        .filter(|(_, q)| {
            let t = q.question.trim();
            t.len() >= 16 && calibration.iter().any(|m| m.contains(t))
        })
        .map(|(i, _)| i)
        .collect()
}

/// Accuracy's bootstrap standard error: 1,000 resamples of the questions, a fixed seed (the same figure
/// on every machine).
pub fn bootstrap_se(correct: &[bool]) -> f64 {
    let n = correct.len();
    if n < 2 {
        return 0.0;
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        // splitmix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let accs: Vec<f64> = (0..1000)
        .map(|_| {
            (0..n)
                .filter(|_| correct[(next() % n as u64) as usize])
                .count() as f64
                / n as f64
        })
        .collect();
    let m = accs.iter().sum::<f64>() / accs.len() as f64;
    (accs.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / (accs.len() - 1) as f64).sqrt()
}

/// The report of a run: accuracy ± SE, per subject, every question's chosen letter.
pub fn report(qs: &[Question], chosen: &[usize]) -> serde_json::Value {
    let correct: Vec<bool> = qs.iter().zip(chosen).map(|(q, &c)| q.answer == c).collect();
    let acc = correct.iter().filter(|&&c| c).count() as f64 / qs.len() as f64;
    let mut subj: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for (q, &c) in qs.iter().zip(&correct) {
        let e = subj.entry(q.subject.as_str()).or_default();
        e.0 += c as usize;
        e.1 += 1;
    }
    serde_json::json!({
        "accuracy": acc,
        "accuracy_se": bootstrap_se(&correct),
        "questions": qs.len(),
        "subjects": subj.iter().map(|(s, (c, n))| serde_json::json!({"subject": s, "correct": c, "questions": n, "accuracy": *c as f64 / *n as f64})).collect::<Vec<_>>(),
        "answers": chosen.iter().map(|&c| LETTERS[c]).collect::<Vec<_>>(),
    })
}

/// Per-question agreement of two runs' answers (the same questions in the same order).
pub fn agreement(a: &[String], b: &[String]) -> Option<f64> {
    (a.len() == b.len() && !a.is_empty())
        .then(|| a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_and_jsonl_read_the_same_question() {
        let d = tempfile::tempdir().unwrap();
        let c = d.path().join("astronomy_test.csv");
        std::fs::write(
            &c,
            "\"What is the Sun, mostly?\",Iron,\"Hydrogen, mostly\",Rock,Ice,B\n",
        )
        .unwrap();
        let j = d.path().join("q.jsonl");
        std::fs::write(
            &j,
            r#"{"question": "What is the Sun, mostly?", "choices": ["Iron", "Hydrogen, mostly", "Rock", "Ice"], "answer": 1, "subject": "astronomy"}"#,
        )
        .unwrap();
        assert_eq!(load(&c).unwrap(), load(&j).unwrap());
        assert!(prompt(&load(&c).unwrap()[0]).ends_with("D. Ice\nAnswer:"));
        std::fs::write(&c, "q,a,b,c,d,E\n").unwrap();
        assert!(load(&c).unwrap_err().contains("line 1"));
    }

    #[test]
    fn choose_and_se() {
        let mut l = vec![0.0f32; 10];
        l[7] = 3.0;
        assert_eq!(choose(&l, &[1, 4, 7, 9]), 2);
        let c: Vec<bool> = (0..400).map(|i| i % 2 == 0).collect();
        let se = bootstrap_se(&c);
        assert!((se - 0.025).abs() < 0.004, "{se}");
    }
}
