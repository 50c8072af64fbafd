//! Attention's two activation MatMuls at E2B's decode shapes (8 query heads on one KV head, head_dim 256,
//! a 288-slot ring): `cargo run --release -p hexq-kernels --example attn_bench`. Best of 7, single thread.
use hexq_kernels::matmul_slices;
use std::time::Instant;

fn main() {
    println!("| product | m×k×n | µs | GFLOP/s |");
    println!("|---|---|---|---|");
    for (m, d, ring) in [(8usize, 256usize, 288usize), (8, 512, 288)] {
        let q: Vec<f32> = (0..m * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let kv: Vec<f32> = (0..ring * d)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.02)
            .collect();
        let p: Vec<f32> = (0..m * ring).map(|i| (i % 13) as f32 * 0.01).collect();
        for (name, a, dims, keys) in [
            ("q·Kᵀ", &q, (m, d, ring), true),
            ("p·V", &p, (m, ring, d), false),
        ] {
            let mut best = f64::MAX;
            for _ in 0..7 {
                let t = Instant::now();
                for _ in 0..100 {
                    std::hint::black_box(matmul_slices(a, &kv, dims, keys));
                }
                best = best.min(t.elapsed().as_secs_f64() / 100.0);
            }
            let gf = 2.0 * (dims.0 * dims.1 * dims.2) as f64 / best / 1e9;
            println!(
                "| {name} | {}×{}×{} | {:.1} | {gf:.1} |",
                dims.0,
                dims.1,
                dims.2,
                best * 1e6
            );
        }
    }
}
