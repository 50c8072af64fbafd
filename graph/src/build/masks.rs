//! Attention masks (NEG = -1e4 where a key must not be seen) and the ring-buffer write indices, computed
//! in-graph from the positions: one set per (buffer length, window) pair, shared by the layers that use it.

use super::ctx::Ctx;
use super::Variant;
use crate::ir::{DType, Op};

/// Mask and ring-write tensors for one (buffer length, window) pair.
#[derive(Clone)]
pub(super) struct Masks {
    /// decode: which buffer entry is this call's write slot, [1, 1, B, 1] bool.
    pub slot: Option<String>,
    /// decode: [B] additive mask over the buffer; trunk: [G*S, B+S] over past ring + chunk.
    pub mask: String,
    /// trunk: chunk index to gather for every ring slot [B], and whether the slot keeps its past entry [B, 1].
    pub write_idx: Option<String>,
    pub write_has: Option<String>,
}

/// The tensors both mask kinds start from: names' tag, entry index [B], the buffer length.
struct Buf {
    tag: String,
    len: usize,
    iota: String,
    blen: String,
}

impl Ctx<'_> {
    /// Masks for a buffer of `len` entries read by layers with `window` (None = full attention), `g` query
    /// heads per KV head (trunk masks are tiled G times so they add to [G*S, T] scores without broadcasting
    /// a 5-D tensor).
    pub fn masks(&mut self, len: usize, window: Option<usize>, g: usize) -> Masks {
        let key = (len, window, if self.v == Variant::Trunk { g } else { 1 });
        if let Some(m) = self.masks.get(&key) {
            return m.clone();
        }
        let tag = match window {
            Some(w) => format!("b{len}_w{w}"),
            None => format!("b{len}"),
        };
        let iota = self.b.const_i64(
            &format!("mask.{tag}.slot_idx"),
            &[len],
            (0..len as i64).collect(),
        );
        let blen = self.i(&format!("mask.{tag}.len"), len as i64);
        let buf = Buf {
            tag,
            len,
            iota,
            blen,
        };
        let m = match self.cache_pos.clone() {
            Some(cp) => self.decode_masks(&buf, &cp, window),
            None => self.trunk_masks(&buf, window, key.2),
        };
        self.masks.insert(key, m.clone());
        m
    }

    /// decode: slot = cache_position % len. Slot i is valid iff written (i <= p); with a window shorter than
    /// the buffer (decode_full's sliding layers) also i > p - W. Slot i == position i there.
    fn decode_masks(&mut self, buf: &Buf, cp: &str, window: Option<usize>) -> Masks {
        let Buf {
            tag,
            len,
            iota,
            blen,
        } = buf;
        let (neg, zero) = (self.neg.clone(), self.zero.clone());
        let p = self.n(Op::Cast { to: DType::I64 }, &[cp], &format!("mask.{tag}.p"));
        let slot = self.imod(&p, blen, &format!("kv.{tag}.slot"));
        // The ring write is a select, not a ScatterND: Where(entry == slot, new row, past) broadcasts the
        // row over the buffer. QNN's HTP backend fails to finalize ScatterND on int16 KV (measured with
        // onnxruntime-qnn 2.7 / QNN 2.51, issue 8), and Where is what the trunk's ring write uses already.
        let is_slot = self.n(Op::Equal, &[iota, &slot], &format!("kv.{tag}.is_slot"));
        let slot = self.reshape(
            &is_slot,
            &[1, 1, *len as i64, 1],
            &format!("kv.{tag}.is_slot4"),
        );
        let future = self.n(Op::Greater, &[iota, &p], &format!("mask.{tag}.unwritten"));
        let mut mask = self.n(
            Op::Where,
            &[&future, &neg, &zero],
            &format!("mask.{tag}.causal"),
        );
        if let Some(w) = window.filter(|&w| w < *len) {
            mask = self.window(tag, &p, iota, w, &mask);
        }
        Masks {
            slot: Some(slot),
            mask,
            write_idx: None,
            write_has: None,
        }
    }

    /// Keys older than the window (position < query − (W − 1)) masked too.
    fn window(&mut self, tag: &str, q: &str, kpos: &str, w: usize, mask: &str) -> String {
        let w1 = self.i(&format!("mask.{tag}.w_minus_1"), w as i64 - 1);
        let lo = self.n(Op::Sub, &[q, &w1], &format!("mask.{tag}.lo"));
        let old = self.n(
            Op::Less,
            &[kpos, &lo],
            &format!("mask.{tag}.outside_window"),
        );
        let neg = self.neg.clone();
        self.n(
            Op::Where,
            &[&old, &neg, mask],
            &format!("mask.{tag}.window"),
        )
    }

    /// trunk: keys are [past ring, chunk]; past slot i holds position prev − ((prev − i) mod len),
    /// prev = p0 − 1 (negative = never written); chunk key j is position p0 + j, padding past valid_len.
    fn trunk_masks(&mut self, buf: &Buf, window: Option<usize>, tiles: usize) -> Masks {
        let Buf {
            tag, iota, blen, ..
        } = buf;
        let (neg, zero) = (self.neg.clone(), self.zero.clone());
        let s = self.s as i64;
        let vl = self.valid_len.clone().expect("trunk graphs have valid_len");
        let vl = self.n(
            Op::Cast { to: DType::I64 },
            &[&vl],
            &format!("mask.{tag}.valid_len"),
        );
        let pos64 = self.pos64.clone();
        let p0 = self.slice(&pos64, 0, 1, 1, &format!("mask.{tag}.p0"));
        let p0 = self.reshape(&p0, &[1], &format!("mask.{tag}.p0_flat"));
        let one = self.i(&format!("mask.{tag}.one"), 1);
        let zero_i = self.i(&format!("mask.{tag}.zero_i"), 0);
        let prev = self.n(Op::Sub, &[&p0, &one], &format!("mask.{tag}.prev"));
        let names = ["prev_minus_slot", "past_age", "past_pos"].map(|n| format!("mask.{tag}.{n}"));
        let ppos = self.slot_position(&prev, iota, blen, &names);
        let pinv = self.n(
            Op::Less,
            &[&ppos, &zero_i],
            &format!("mask.{tag}.past_unwritten"),
        );
        let cpos = self.reshape(&pos64, &[s], &format!("mask.{tag}.chunk_pos"));
        let cidx = self.b.const_i64(
            &format!("mask.{tag}.chunk_idx"),
            &[self.s],
            (0..s).collect(),
        );
        let vl1 = self.n(Op::Sub, &[&vl, &one], &format!("mask.{tag}.last_idx"));
        let cinv = self.n(
            Op::Greater,
            &[&cidx, &vl1],
            &format!("mask.{tag}.chunk_padding"),
        );
        let kpos = self.n(
            Op::Concat { axis: 0 },
            &[&ppos, &cpos],
            &format!("mask.{tag}.key_pos"),
        ); // [T]
        let kinv = self.n(
            Op::Concat { axis: 0 },
            &[&pinv, &cinv],
            &format!("mask.{tag}.key_invalid"),
        );
        let q = self.reshape(&pos64, &[s, 1], &format!("mask.{tag}.query_pos")); // [S,1]
        let fut = self.n(Op::Greater, &[&kpos, &q], &format!("mask.{tag}.future")); // [S,T]
        let mut mask = self.n(
            Op::Where,
            &[&fut, &neg, &zero],
            &format!("mask.{tag}.causal"),
        );
        if let Some(w) = window {
            mask = self.window(tag, &q, &kpos, w, &mask);
        }
        mask = self.n(
            Op::Where,
            &[&kinv, &neg, &mask],
            &format!("mask.{tag}.valid"),
        );
        if tiles > 1 {
            let reps: Vec<&str> = std::iter::repeat_n(mask.as_str(), tiles).collect();
            mask = self.n(
                Op::Concat { axis: 0 },
                &reps,
                &format!("mask.{tag}.g{tiles}"),
            );
        }
        let (write_idx, write_has) = self.ring_write(buf, &p0, &vl1, &zero_i);
        Masks {
            slot: None,
            mask,
            write_idx: Some(write_idx),
            write_has: Some(write_has),
        }
    }

    /// The position ring slot i holds when `newest` is the last position written:
    /// newest − ((newest − i) mod len) (negative: never written). `names`: the three nodes' names.
    fn slot_position(
        &mut self,
        newest: &str,
        iota: &str,
        blen: &str,
        names: &[String; 3],
    ) -> String {
        let d = self.n(Op::Sub, &[newest, iota], &names[0]);
        let age = self.imod(&d, blen, &names[1]);
        self.n(Op::Sub, &[newest, &age], &names[2])
    }

    /// Ring write: slot i takes the newest chunk position ≡ i (mod len), if any:
    /// last = p0 + valid_len - 1; pos = last - ((last - i) mod len); j = pos - p0; new iff j >= 0.
    fn ring_write(&mut self, buf: &Buf, p0: &str, vl1: &str, zero_i: &str) -> (String, String) {
        let Buf {
            tag,
            len,
            iota,
            blen,
        } = buf;
        let last = self.n(Op::Add, &[p0, vl1], &format!("kv.{tag}.last_pos"));
        let names = ["last_minus_slot", "age", "new_pos"].map(|n| format!("kv.{tag}.{n}"));
        let npos = self.slot_position(&last, iota, blen, &names);
        let j = self.n(Op::Sub, &[&npos, p0], &format!("kv.{tag}.chunk_j"));
        let has = self.n(Op::Less, &[&j, zero_i], &format!("kv.{tag}.keeps_past"));
        let jc = self.n(
            Op::Where,
            &[&has, zero_i, &j],
            &format!("kv.{tag}.gather_idx"),
        );
        let has2 = self.reshape(&has, &[*len as i64, 1], &format!("kv.{tag}.keeps_past_col"));
        (jc, has2)
    }
}
