#[cfg(target_arch = "x86_64")]
use super::x86::*;
use super::*;

/// `RowWeight::row` gives each stored form's f32 values: bf16 widened, grouped integers × their scale.
#[test]
fn row_widens_each_form() {
    let q: Vec<i16> = (0..64).map(|k| k as i16 - 32).collect();
    let scale = vec![0.5f32, 0.25];
    let w = RowWeight {
        out: 1,
        inp: 64,
        rows: Rows::Q16 {
            q,
            scale,
            group: 32,
        },
    };
    let mut buf = Vec::new();
    let r = w.row(0, &mut buf);
    assert_eq!((r[0], r[31], r[32], r[63]), (-16.0, -0.5, 0.0, 7.75));
    let b = RowWeight {
        out: 2,
        inp: 1,
        rows: Rows::Bf16(vec![0x3f80, 0xc000]),
    };
    assert_eq!(b.row(1, &mut buf), &[-2.0]);
}

fn lcg(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// The AVX2 kernel equals the scalar reference bit for bit, for f32, bf16 and grouped integer rows, with
/// every tail: rows past the 6-row tile, outputs past a 16-wide panel, inputs past a 256 chunk and past a
/// group of four (1, 2, 3 left).
#[cfg(target_arch = "x86_64")]
#[test]
fn every_vector_kernel_equals_the_reference() {
    if !avx2() {
        eprintln!("no AVX2 + FMA here: only the scalar order runs");
        return;
    }
    for (rows, out, inp) in [
        (9usize, 7usize, 77usize),
        (25, 19, 300),
        (35, 16, 64),
        (23, 33, 40),
        (13, 11, 96),
        (4, 3, 16),
        (1, 5, 5),
        (17, 4, 2048),
        (5, 37, 517),
        (6, 33, 262),
        (3, 16, 259),
        (2, 18, 1536),
    ] {
        let x = lcg(rows * inp, 5);
        let wf = lcg(out * inp, 6);
        let bf: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let q: Vec<i16> = (0..out * inp)
            .map(|i| (i as i64 * 7919 % 255 - 127) as i16)
            .collect();
        let group = if inp % 16 == 0 { 16 } else { inp };
        let sc: Vec<f32> = (0..out * inp / group)
            .map(|b| 1e-3 * (b % 13 + 1) as f32)
            .collect();
        // The bf16 rows also from a mapping, one byte off alignment (a safetensors offset may be odd).
        let mut m = memmap2::MmapMut::map_anon(1 + 2 * bf.len()).unwrap();
        for (i, b) in bf.iter().enumerate() {
            m[1 + 2 * i..3 + 2 * i].copy_from_slice(&b.to_le_bytes());
        }
        let map = std::sync::Arc::new(m.make_read_only().unwrap());
        let forms = [
            Rows::F32(wf.clone()),
            Rows::Bf16(bf),
            Rows::Bf16Mapped { map, start: 1 },
            Rows::Q16 {
                q: q.clone(),
                scale: sc.clone(),
                group,
            },
            Rows::ints(q, sc, group, inp),
        ];
        assert!(
            matches!(forms[4], Rows::Q8 { .. }),
            "values in ±127 are kept in a byte"
        );
        for rows_form in forms {
            let w = RowWeight {
                out,
                inp,
                rows: rows_form,
            };
            let mut buf = Vec::new();
            let widened: Vec<f32> = (0..out).flat_map(|j| w.row(j, &mut buf).to_vec()).collect();
            let mut want = vec![0f32; rows * out];
            block_ref(&x, rows, inp, &widened, out, &mut want);
            let src = match &w.rows {
                Rows::F32(v) => Src::F32(v.as_ptr()),
                Rows::Bf16(v) => Src::Bf16(v.as_ptr()),
                Rows::Bf16Mapped { map, start } => Src::Bf16(map[*start..].as_ptr() as *const u16),
                Rows::Q16 { q, scale, group } => {
                    let (ng, shift) = groups(*group, inp);
                    Src::Q16(q.as_ptr(), scale.as_ptr(), ng, shift)
                }
                Rows::Q8 { q, scale, group } => {
                    let (ng, shift) = groups(*group, inp);
                    Src::Q8(q.as_ptr(), scale.as_ptr(), ng, shift)
                }
            };
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let mut got = vec![0f32; rows * out];
            unsafe { block_avx2(&x, rows, inp, src, out, &mut got) };
            assert_eq!(bits(&got), bits(&want), "avx2 {rows}x{out}x{inp}");
            if std::is_x86_feature_detected!("avx512f") {
                let mut got = vec![0f32; rows * out];
                unsafe { block_avx512(&x, rows, inp, src, out, &mut got) };
                assert_eq!(bits(&got), bits(&want), "avx512 {rows}x{out}x{inp}");
            }
        }
    }
}

/// One row at a time equals the batch, bit for bit; bf16 rows equal their f32 widening; close to f64.
#[test]
fn batch_invariant_and_exact_for_bf16() {
    let (out, inp, rows) = (150, 77, 9);
    let wf = lcg(out * inp, 1);
    let bf: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    let widened: Vec<f32> = bf
        .iter()
        .map(|&b| f32::from_bits((b as u32) << 16))
        .collect();
    let x = lcg(rows * inp, 2);
    let w16 = RowWeight {
        out,
        inp,
        rows: Rows::Bf16(bf),
    };
    let w32 = RowWeight {
        out,
        inp,
        rows: Rows::F32(widened.clone()),
    };
    let batch = matmul(&x, rows, &w16);
    // Integer rows: q·scale_j widened exactly as f32 rows holding those values.
    let q: Vec<i16> = (0..out * inp)
        .map(|i| (i as i64 * 7919 % 255 - 127) as i16)
        .collect();
    let sc: Vec<f32> = (0..out).map(|j| 0.001 * (j + 1) as f32).collect();
    let qf: Vec<f32> = (0..out * inp).map(|i| q[i] as f32 * sc[i / inp]).collect();
    let wq = RowWeight {
        out,
        inp,
        rows: Rows::ints(q.clone(), sc, inp, inp),
    };
    let wqf = RowWeight {
        out,
        inp,
        rows: Rows::F32(qf),
    };
    assert_eq!(matmul(&x, rows, &wq), matmul(&x, rows, &wqf));
    // Group scales (16 and 32 inputs per scale): the same as f32 rows holding q · scale[group].
    for g in [16usize, 32] {
        let inp = 96;
        let q: Vec<i16> = (0..out * inp)
            .map(|i| (i as i64 * 31 % 15 - 7) as i16)
            .collect();
        let sc: Vec<f32> = (0..out * inp / g)
            .map(|b| 1e-3 * (b % 13 + 1) as f32)
            .collect();
        let qf: Vec<f32> = (0..out * inp).map(|i| q[i] as f32 * sc[i / g]).collect();
        let x = lcg(rows * inp, 3);
        let wg = RowWeight {
            out,
            inp,
            rows: Rows::Q16 {
                q,
                scale: sc,
                group: g,
            },
        };
        let wf = RowWeight {
            out,
            inp,
            rows: Rows::F32(qf),
        };
        assert_eq!(matmul(&x, rows, &wg), matmul(&x, rows, &wf), "group {g}");
    }
    let mut reference = vec![0f32; rows * out];
    block_ref(&x, rows, inp, &widened, out, &mut reference);
    assert!(
        reference
            .iter()
            .zip(&batch)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "vector path != reference order"
    );
    assert_eq!(batch, matmul(&x, rows, &w32));
    for r in 0..rows {
        let one = matmul(&x[r * inp..(r + 1) * inp], 1, &w16);
        assert!(one
            .iter()
            .zip(&batch[r * out..(r + 1) * out])
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        for j in 0..out {
            let e: f64 = (0..inp)
                .map(|k| x[r * inp + k] as f64 * widened[j * inp + k] as f64)
                .sum();
            assert!((one[j] as f64 - e).abs() < 1e-5, "{} vs {e}", one[j]);
        }
    }
}
