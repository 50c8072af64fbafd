//! The weight kernel alone at E2B's shapes: `cargo run --release -p hexq-kernels --example rowmm_bench`.
//! Prints GFLOP/s per (weight shape, stored form, rows), best of 5 — the figure `HEXQ_PROFILE` reports
//! inside a calibration, without the rest of the graph.

use hexq_kernels::rowmm::{matmul, RowWeight};
use std::time::Instant;

fn main() {
    let shapes = [
        (6144usize, 1536usize, "gate/up"),
        (1536, 6144, "down"),
        (2048, 1536, "q_proj"),
    ];
    println!("| weight [out, in] | rows | stored | ms | GFLOP/s |");
    println!("|---|---|---|---|---|");
    for (out, inp, name) in shapes {
        let q: Vec<i16> = (0..out * inp)
            .map(|i| (i as i64 * 7919 % 255 - 127) as i16)
            .collect();
        let scale: Vec<f32> = (0..out).map(|j| 1e-3 * (1 + j % 7) as f32).collect();
        let bf: Vec<u16> = (0..out * inp).map(|i| 0x3c00 + (i % 251) as u16).collect();
        let forms = [
            (
                "int8 (Q8)",
                RowWeight::ints(out, inp, q.clone(), scale.clone(), inp),
            ),
            ("bf16", RowWeight::bf16(out, inp, bf)),
        ];
        // Cold: 16 copies of the weight cycled (≈ 300 MB, past the caches), as a model's layers stream by.
        let copies: Vec<RowWeight> = (0..16)
            .map(|_| RowWeight::ints(out, inp, q.clone(), scale.clone(), inp))
            .collect();
        let x: Vec<f32> = (0..64 * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let t = Instant::now();
        for w in &copies {
            std::hint::black_box(matmul(&x, 64, w));
        }
        let dt = t.elapsed().as_secs_f64() / copies.len() as f64;
        let gf = 2.0 * (64 * out * inp) as f64 / dt / 1e9;
        println!(
            "| {name} [{out}, {inp}] | 64 | int8 (Q8), cold | {:.2} | {gf:.1} |",
            dt * 1e3
        );
        for rows in [16usize, 64, 128] {
            let x: Vec<f32> = (0..rows * inp)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
                .collect();
            for (form, w) in &forms {
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = Instant::now();
                    std::hint::black_box(matmul(&x, rows, w));
                    best = best.min(t.elapsed().as_secs_f64());
                }
                let gf = 2.0 * (rows * out * inp) as f64 / best / 1e9;
                println!(
                    "| {name} [{out}, {inp}] | {rows} | {form} | {:.2} | {gf:.1} |",
                    best * 1e3
                );
            }
        }
    }
}
