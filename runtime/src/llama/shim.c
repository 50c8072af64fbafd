// A seven-function C surface over llama.cpp's API for hexq's `llama` backend. Compiled at first use against the
// llama.cpp build the user points at (headers + libllama.so) and loaded with dlopen, so hexq has no link-time
// dependency on llama.cpp and no struct layouts to mirror in Rust.
#include "llama.h"
#include <stdlib.h>
#include <string.h>

typedef struct {
    struct llama_model * model;
    struct llama_context * ctx;
    int n_vocab;
} hq_t;

void * hq_load(const char * path, int n_ctx, int n_threads) {
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * m = llama_model_load_from_file(path, mp);
    if (!m) return NULL;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;
    cp.n_ubatch = n_ctx;
    if (n_threads > 0) { cp.n_threads = n_threads; cp.n_threads_batch = n_threads; }
    struct llama_context * c = llama_init_from_model(m, cp);
    if (!c) { llama_model_free(m); return NULL; }
    hq_t * h = calloc(1, sizeof(hq_t));
    h->model = m;
    h->ctx = c;
    h->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(m));
    return h;
}

int hq_n_vocab(void * p) { return ((hq_t *) p)->n_vocab; }

void hq_reset(void * p) { llama_memory_clear(llama_get_memory(((hq_t *) p)->ctx), 1); }

// Feed tokens at the next positions; copy the last position's logits into out[n_vocab]. 0 on success.
int hq_eval(void * p, const int * tokens, int n, float * out) {
    hq_t * h = p;
    struct llama_batch b = llama_batch_get_one((llama_token *) tokens, n);
    int r = llama_decode(h->ctx, b);
    if (r != 0) return r;
    const float * l = llama_get_logits_ith(h->ctx, -1);
    if (!l) return -1;
    memcpy(out, l, sizeof(float) * h->n_vocab);
    return 0;
}

// Feed tokens at positions 0..n-1 of a cleared cache, one batch; copy the logits of positions from..n-1 into
// out[(n - from) * n_vocab]. 0 on success.
int hq_eval_all(void * p, const int * tokens, int n, int from, float * out) {
    hq_t * h = p;
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = tokens[i];
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = i >= from;
    }
    b.n_tokens = n;
    int r = llama_decode(h->ctx, b);
    for (int i = from; r == 0 && i < n; i++) {
        const float * l = llama_get_logits_ith(h->ctx, i);
        if (!l) r = -1;
        else memcpy(out + (size_t) (i - from) * h->n_vocab, l, sizeof(float) * h->n_vocab);
    }
    llama_batch_free(b);
    return r;
}

void hq_free(void * p) {
    hq_t * h = p;
    llama_free(h->ctx);
    llama_model_free(h->model);
    free(h);
}
