//! Backend `llama`: a GGUF run by llama.cpp, with hexq's host loop (chat template, greedy, stops). llama.cpp is
//! the one the user built (`LLAMA_CPP_BUILD` = its build dir, headers beside it in the source tree); a small C
//! shim (`llama/shim.c`) is compiled against it at first use and loaded with dlopen — no link-time dependency,
//! and no llama.cpp struct layouts mirrored in Rust. The softcap is inside llama.cpp's gemma4 graph.

use crate::Error;
use crate::{Backend, Result};
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::{Path, PathBuf};

const SHIM: &str = include_str!("llama/shim.c");

type Load = unsafe extern "C" fn(*const c_char, c_int, c_int) -> *mut c_void;
type NVocab = unsafe extern "C" fn(*mut c_void) -> c_int;
type Reset = unsafe extern "C" fn(*mut c_void);
type Eval = unsafe extern "C" fn(*mut c_void, *const c_int, c_int, *mut f32) -> c_int;
type Free = unsafe extern "C" fn(*mut c_void);
type EvalAll = unsafe extern "C" fn(*mut c_void, *const c_int, c_int, c_int, *mut f32) -> c_int;

pub struct LlamaBackend {
    _lib: libloading::Library,
    h: *mut c_void,
    n_vocab: usize,
    eval: Eval,
    eval_all: EvalAll,
    reset: Reset,
    free: Free,
    pub pos: usize,
    pub n_ctx: usize,
}

/// The llama.cpp build directory: `$LLAMA_CPP_BUILD` (with bin/libllama.so or lib/libllama.so).
pub fn llama_build() -> Result<PathBuf> {
    let d = std::env::var("LLAMA_CPP_BUILD").map_err(|_| {
        Error::Missing {
            tool: "llama.cpp",
            hint: "set LLAMA_CPP_BUILD to a llama.cpp build directory (bin/libllama.so; .ci/run builds one)",
            detail: "LLAMA_CPP_BUILD is not set".into(),
        }
    })?;
    Ok(PathBuf::from(d))
}

fn find(build: &Path, name: &str) -> Option<PathBuf> {
    ["bin", "lib", "src", ""]
        .iter()
        .map(|s| build.join(s).join(name))
        .find(|p| p.exists())
}

/// Compile the shim against `build` (cached by content hash).
fn shim(build: &Path) -> Result<PathBuf> {
    use sha2::{Digest, Sha256};
    let lib = find(build, "libllama.so")
        .ok_or_else(|| Error::file(build, "no libllama.so in this llama.cpp build"))?;
    let src = build.parent().unwrap_or(build);
    let (inc, ginc) = (src.join("include"), src.join("ggml/include"));
    if !inc.join("llama.h").exists() {
        return Err(Error::file(
            &inc,
            "no llama.h (LLAMA_CPP_BUILD must be <llama.cpp source>/build)",
        ));
    }
    let mut h = Sha256::new();
    h.update(SHIM);
    h.update(lib.to_string_lossy().as_bytes());
    h.update(
        std::fs::metadata(&lib)
            .map(|m| m.len())
            .unwrap_or(0)
            .to_le_bytes(),
    );
    let key = format!("{:x}", h.finalize());
    let cache = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or(std::env::temp_dir())
        .join(".cache/hexq");
    std::fs::create_dir_all(&cache).map_err(|e| Error::io(&cache, e))?;
    let so = cache.join(format!("llama-shim-{}.so", &key[..16]));
    if so.exists() {
        return Ok(so);
    }
    let c = cache.join(format!("llama-shim-{}.c", &key[..16]));
    std::fs::write(&c, SHIM).map_err(|e| Error::io(&c, e))?;
    let tmp = so.with_extension(format!("so.tmp-{}", std::process::id()));
    let libdir = lib.parent().unwrap();
    let o = std::process::Command::new(std::env::var("CC").unwrap_or("cc".into()))
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&tmp)
        .arg(&c)
        .arg(format!("-I{}", inc.display()))
        .arg(format!("-I{}", ginc.display()))
        .arg(format!("-L{}", libdir.display()))
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-lllama")
        .output()
        .map_err(|e| Error::Llama(format!("compiling the shim: {e}")))?;
    if !o.status.success() {
        return Err(Error::Llama(format!(
            "compiling the shim failed:\n{}",
            String::from_utf8_lossy(&o.stderr)
        )));
    }
    std::fs::rename(&tmp, &so).map_err(|e| Error::io(&so, e))?;
    Ok(so)
}

impl LlamaBackend {
    pub fn open(gguf: &Path, n_ctx: usize, threads: usize) -> Result<Self> {
        let so = shim(&llama_build()?)?;
        // SAFETY: the shim is our own C file compiled above; the symbols have the declared signatures.
        unsafe {
            let lib = libloading::Library::new(&so).map_err(|e| Error::file(&so, e.to_string()))?;
            let load: Load = *lib
                .get::<Load>(b"hq_load")
                .map_err(|e| Error::Llama(e.to_string()))?;
            let nv: NVocab = *lib
                .get::<NVocab>(b"hq_n_vocab")
                .map_err(|e| Error::Llama(e.to_string()))?;
            let eval: Eval = *lib
                .get::<Eval>(b"hq_eval")
                .map_err(|e| Error::Llama(e.to_string()))?;
            let eval_all: EvalAll = *lib
                .get::<EvalAll>(b"hq_eval_all")
                .map_err(|e| Error::Llama(e.to_string()))?;
            let reset: Reset = *lib
                .get::<Reset>(b"hq_reset")
                .map_err(|e| Error::Llama(e.to_string()))?;
            let free: Free = *lib
                .get::<Free>(b"hq_free")
                .map_err(|e| Error::Llama(e.to_string()))?;
            let p = CString::new(gguf.to_string_lossy().as_bytes()).unwrap();
            let h = load(p.as_ptr(), n_ctx as c_int, threads as c_int);
            if h.is_null() {
                return Err(Error::file(
                    gguf,
                    "llama.cpp could not load this GGUF (see its log above)",
                ));
            }
            let n_vocab = nv(h) as usize;
            Ok(LlamaBackend {
                _lib: lib,
                h,
                n_vocab,
                eval,
                eval_all,
                reset,
                free,
                pos: 0,
                n_ctx,
            })
        }
    }
}

impl Drop for LlamaBackend {
    fn drop(&mut self) {
        // SAFETY: h came from hq_load and is freed once.
        unsafe { (self.free)(self.h) }
    }
}

impl Backend for LlamaBackend {
    fn name(&self) -> &str {
        "llama"
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.n_ctx)
    }
    fn reset(&mut self) {
        // SAFETY: valid handle.
        unsafe { (self.reset)(self.h) };
        self.pos = 0;
    }
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        if self.pos + ids.len() > self.n_ctx {
            return Err(Error::ContextFull(format!(
                " {} + {} > {}",
                self.pos,
                ids.len(),
                self.n_ctx
            )));
        }
        let toks: Vec<c_int> = ids.iter().map(|&i| i as c_int).collect();
        let mut out = vec![0f32; self.n_vocab];
        // SAFETY: toks and out live across the call; out has n_vocab floats.
        let r =
            unsafe { (self.eval)(self.h, toks.as_ptr(), toks.len() as c_int, out.as_mut_ptr()) };
        if r != 0 {
            return Err(Error::Llama(format!("llama_decode returned {r}")));
        }
        self.pos += ids.len();
        Ok(out)
    }
    /// From a cleared cache: the whole of `ids` in one batch, logits kept from `from` on (as
    /// llama-perplexity's batch does); otherwise one position at a time.
    fn feed_all(&mut self, ids: &[u32], from: usize) -> Result<Vec<Vec<f32>>> {
        if self.pos != 0 || ids.len() > self.n_ctx || from >= ids.len() {
            return crate::feed_each(self, ids, from);
        }
        let toks: Vec<c_int> = ids.iter().map(|&i| i as c_int).collect();
        let n = ids.len() - from;
        let mut out = vec![0f32; n * self.n_vocab];
        // SAFETY: toks and out live across the call; out holds (len − from) rows of n_vocab floats.
        let r = unsafe {
            (self.eval_all)(
                self.h,
                toks.as_ptr(),
                toks.len() as c_int,
                from as c_int,
                out.as_mut_ptr(),
            )
        };
        if r != 0 {
            return Err(Error::Llama(format!("llama_decode returned {r}")));
        }
        self.pos = ids.len();
        Ok(out.chunks(self.n_vocab).map(|c| c.to_vec()).collect())
    }
}
