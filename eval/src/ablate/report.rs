//! The report as a table (markdown, CSV) and a plot (SVG).

use super::Report;

impl Report {
    pub fn markdown(&self) -> String {
        let classes: Vec<String> = {
            let mut c: Vec<String> = self
                .rows
                .iter()
                .flat_map(|r| r.sqnr_db.keys().cloned())
                .collect();
            c.sort();
            c.dedup();
            c
        };
        // The activations column only when a build sits beside the weights-only grids.
        let acts = self.rows.iter().any(|r| r.activations != "float");
        // The rounding and head columns when some row is not to nearest with a float head.
        let cross = self
            .rows
            .iter()
            .any(|r| r.rounding != "rtn" || r.head != "float");
        let mut s = format!(
            "{}ablation{} — {} prompts, {} positions; float perplexity {:.3}\n\n| scheme |{}{} bits/weight | decoder MiB | {} | top-1 vs float | KL mean | perplexity | hidden cos |\n|---|{}{}---|---|{}---|---|---|---|\n",
            if acts { "" } else { "weights-only " },
            if self.heavy_tail { " (heavy-tailed input channels)" } else { "" },
            self.prompts,
            self.positions,
            self.float_perplexity,
            if cross { " rounding | head |" } else { "" },
            if acts { " activations |" } else { "" },
            classes.iter().map(|c| format!("SQNR {c} dB")).collect::<Vec<_>>().join(" | "),
            if cross { "---|---|" } else { "" },
            if acts { "---|" } else { "" },
            "---|".repeat(classes.len())
        );
        for r in &self.rows {
            s += &format!(
                "| {} |{}{} {:.3} | {:.2} | {} | {:.1} % | {:.4} | {:.3} | {:.5} |\n",
                r.scheme,
                if cross {
                    format!(" {} | {} |", r.rounding, r.head)
                } else {
                    String::new()
                },
                if acts {
                    format!(" {} |", r.activations)
                } else {
                    String::new()
                },
                r.bits_per_weight,
                r.decoder_mib,
                classes
                    .iter()
                    .map(|c| r
                        .sqnr_db
                        .get(c)
                        .map(|v| format!("{v:.1}"))
                        .unwrap_or("–".into()))
                    .collect::<Vec<_>>()
                    .join(" | "),
                100.0 * r.top1_agreement,
                r.kl_mean,
                r.perplexity,
                r.hidden_cosine_mean
            );
        }
        s
    }

    pub fn csv(&self) -> String {
        let mut s = String::from("scheme,rounding,head,activations,bits_per_weight,decoder_mib,sqnr_attention_db,sqnr_mlp_db,sqnr_embeddings_db,top1_agreement,kl_mean,perplexity,hidden_cosine_mean\n");
        for r in &self.rows {
            let g = |k: &str| {
                r.sqnr_db
                    .get(k)
                    .map(|v| format!("{v:.3}"))
                    .unwrap_or_default()
            };
            s += &format!(
                "{},{},{},{},{:.4},{:.3},{},{},{},{:.5},{:.6},{:.5},{:.6}\n",
                r.scheme,
                r.rounding,
                r.head,
                r.activations,
                r.bits_per_weight,
                r.decoder_mib,
                g("attention"),
                g("mlp"),
                g("embeddings"),
                r.top1_agreement,
                r.kl_mean,
                r.perplexity,
                r.hidden_cosine_mean
            );
        }
        s
    }

    /// Accuracy vs bits/weight as a small SVG (top-1 agreement, and KL on a second axis).
    pub fn svg(&self) -> String {
        let (w, h, m) = (640.0, 400.0, 60.0);
        let xs: Vec<f64> = self.rows.iter().map(|r| r.bits_per_weight).collect();
        let (x0, x1) = (
            xs.iter().cloned().fold(f64::INFINITY, f64::min) - 0.25,
            xs.iter().cloned().fold(0f64, f64::max) + 0.25,
        );
        let kmax = self.rows.iter().map(|r| r.kl_mean).fold(1e-9, f64::max) * 1.1;
        let px = |x: f64| m + (x - x0) / (x1 - x0) * (w - 2.0 * m);
        let py = |y: f64| h - m - y * (h - 2.0 * m);
        let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
        s += &format!("<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>\n", h - m, w - m, h - m, h - m);
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">bits per weight</text>\n",
            w / 2.0,
            h - 20.0
        );
        s += &format!("<text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\" fill=\"#1f77b4\">top-1 agreement vs float (●)</text>\n", h / 2.0, h / 2.0);
        s += &format!("<text x=\"{}\" y=\"{}\" transform=\"rotate(90 {} {})\" text-anchor=\"middle\" fill=\"#d62728\">KL mean (▲, max {kmax:.3})</text>\n", w - 15.0, h / 2.0, w - 15.0, h / 2.0);
        for t in [0.0, 0.25, 0.5, 0.75, 1.0] {
            s += &format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.0}%</text>\n",
                m - 5.0,
                py(t) + 4.0,
                t * 100.0
            );
        }
        for r in &self.rows {
            let (x, y, k) = (
                px(r.bits_per_weight),
                py(r.top1_agreement),
                py(r.kl_mean / kmax),
            );
            s += &format!("<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"5\" fill=\"#1f77b4\"/>\n<path d=\"M{:.1},{:.1} l5,9 l-10,0 z\" fill=\"#d62728\"/>\n", x, k - 6.0);
            s += &format!("<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{:.2}</text>\n", y - 10.0, label(r), h - m + 15.0, r.bits_per_weight);
        }
        s + "</svg>\n"
    }
}

/// A row's name in the plot: the scheme, and its rounding and head when not rtn / float.
fn label(r: &super::Row) -> String {
    let mut s = r.scheme.clone();
    if r.rounding != "rtn" {
        s += &format!(" {}", r.rounding);
    }
    if r.head != "float" {
        s += &format!(" head {}", r.head);
    }
    s
}
