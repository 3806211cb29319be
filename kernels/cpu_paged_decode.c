/* Paged decode attention for the CPU: each query reads its sequence's K/V rows where they
 * lie in the paged cache (no gathered copy), accumulating in float32 from float32 or
 * bfloat16 pages (no widened copy of the cache).
 *
 * Layout (kernels.reference's): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
 * head_dim], contiguous; q [num_seqs, num_q_heads, head_dim] float32 or bfloat16, read in
 * place; block_tables [num_seqs, table_stride] int64; seq_lens [num_seqs] int64; out like q,
 * contiguous, float32 or bfloat16 (kvscope_paged_decode says more). Query head h reads
 * kv head h / (num_q_heads / num_kv_heads) (GQA). A sliding window (window > 0) starts each
 * sequence's keys at len - window: the pages before the one holding that key are not read. The caller validated every length and
 * block id (kernels.cpu_attention.StepPlan does, once per step): this file trusts them.
 *
 * One task per sequence, split over OpenMP threads: a token's row (all kv heads) is read
 * once, front to back through the pages. Two passes: scores for every key, then softmax
 * weights times V. Not split by kv head when sequences are few: each task would read a
 * third of every row with a stride, measured slower in the engine step than the torch
 * gather path once the pages come from DRAM (docs/BENCHMARKS.md, issue 22). Fewer
 * sequences than threads split by key range instead (split-K: each chunk keeps its max
 * and sum, merged exactly after), so one long sequence uses every thread.
 * Where the CPU has AVX-512, the head sizes the engine's models use (64, 128) run a task
 * through the register-resident loops of cpu_decode_avx512.h; the portable loops below
 * take every other shape and CPU.
 * Built by kernels/cpu_native.py with the C compiler at first use; linked against the
 * process's already-loaded libgomp (torch's), so there is one OpenMP thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__GLIBC__) && defined(__x86_64__)
/* glibc's vector expf (libmvec; math.h declares it only under -ffast-math, which this file
 * avoids: linking with it would set flush-to-zero for the whole process) */
__attribute__((__simd__("notinbranch"))) float expf(float);
#endif

static inline float f32_to_f32(float x) { return x; }

#if defined(__AVX512F__)
#include "cpu_decode_avx512.h"
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DP_BF16 1
/* <q, k> over head_dim (a multiple of 32) with AVX512-BF16 dot products: q and k both
 * bfloat16, every product exact in float32, summed in float32 (two instructions for a
 * 64-wide head instead of widening k lane by lane) */
static inline float dot_bf16_dp(const uint16_t *q, const uint16_t *k, int head_dim) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                               (__m512bh)_mm512_loadu_si512(k + d));
    return _mm512_reduce_add_ps(acc);
}
#else
#define HAVE_DP_BF16 0
static inline float dot_bf16_dp(const uint16_t *q, const uint16_t *k, int head_dim) {
    (void)q, (void)k, (void)head_dim;
    return 0.0f; /* never called: qb is NULL without the instructions */
}
#endif

/* One task: one sequence's query heads [0, num_q_heads) over its keys [t0, t1), for pages
 * of element type T read through LOAD (widened to float32 in registers, never copied).
 * Leaves the unnormalized output acc[h] = sum_t exp(s_ht - m_h) v_t with m[h] = max_t s_ht
 * and l[h] = sum_t exp(s_ht - m_h), so that chunks of one sequence merge exactly
 * (split-K). qb: the same query as bfloat16 when it is exactly that and the pages are
 * bfloat16 (pass 1 then uses dot_bf16_dp), else NULL. */
#define DEFINE_ATTEND(NAME, T, LOAD)                                                          \
    static void NAME(const float *q, const uint16_t *qb, const T *k_cache, const T *v_cache, \
                     const int64_t *table, int64_t t0, int64_t t1, int num_q_heads,          \
                     int num_kv_heads, int head_dim, int block_size, float scale, float *acc, \
                     float *m, float *l, float *scores) {                                    \
        const int group = num_q_heads / num_kv_heads, width = num_kv_heads * head_dim;       \
        const int64_t n = t1 - t0;                                                           \
        /* pass 1: scores[h][t] = scale * <q_h, k_t>, each token's row read once, in page   \
         * order (a page is block_size consecutive rows) */                                  \
        for (int64_t t = t0; t < t1; t++) {                                                  \
            const T *k = k_cache + (table[t / block_size] * block_size + t % block_size) *   \
                                       width;                                                \
            for (int h = 0; h < num_q_heads; h++) {                                          \
                const float *qh = q + (int64_t)h * head_dim;                                 \
                const T *kh = k + (int64_t)(h / group) * head_dim;                           \
                float dot = 0.0f;                                                            \
                if (qb != NULL) {                                                            \
                    dot = dot_bf16_dp(qb + (int64_t)h * head_dim, (const uint16_t *)kh,      \
                                      head_dim);                                             \
                } else {                                                                     \
                    _Pragma("omp simd reduction(+ : dot)") for (int d = 0; d < head_dim;     \
                                                                d++) dot += qh[d] *          \
                                                                            LOAD(kh[d]);     \
                }                                                                            \
                scores[(int64_t)h * n + (t - t0)] = dot * scale;                             \
            }                                                                                \
        }                                                                                    \
        /* exp(s - max) per head, in place (vectorized through libmvec with glibc) */       \
        for (int h = 0; h < num_q_heads; h++) {                                              \
            float *sh = scores + (int64_t)h * n;                                             \
            float mh = sh[0];                                                                \
            for (int64_t t = 1; t < n; t++) mh = sh[t] > mh ? sh[t] : mh;                    \
            float total = 0.0f;                                                              \
            _Pragma("omp simd reduction(+ : total)") for (int64_t t = 0; t < n; t++) {       \
                sh[t] = expf(sh[t] - mh);                                                    \
                total += sh[t];                                                              \
            }                                                                                \
            m[h] = mh;                                                                       \
            l[h] = total;                                                                    \
        }                                                                                    \
        /* pass 2: acc_h = sum_t p[h][t] * v_t */                                            \
        memset(acc, 0, sizeof(float) * (size_t)(num_q_heads * head_dim));                    \
        for (int64_t t = t0; t < t1; t++) {                                                  \
            const T *v = v_cache + (table[t / block_size] * block_size + t % block_size) *   \
                                       width;                                                \
            for (int h = 0; h < num_q_heads; h++) {                                          \
                const float p = scores[(int64_t)h * n + (t - t0)];                           \
                const T *vh = v + (int64_t)(h / group) * head_dim;                           \
                float *ah = acc + (int64_t)h * head_dim;                                     \
                _Pragma("omp simd") for (int d = 0; d < head_dim; d++) ah[d] +=             \
                    p * LOAD(vh[d]);                                                         \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_ATTEND(attend_f32, float, f32_to_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, bf16_to_f32)

static void attend(const float *q, const uint16_t *qb, const void *k_cache,
                   const void *v_cache, int is_bf16, const int64_t *table, int64_t t0,
                   int64_t t1, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                   float scale, float *acc, float *m, float *l, float *scores) {
#if HAVE_AVX512
    /* (a bfloat16 query's dot products are exact in float32 either way; the register loops
     * widening bfloat16 keys measured faster than dot_bf16_dp's pairs there) */
    if (avx512_decode_takes(head_dim)) {
        attend_avx512(q, k_cache, v_cache, is_bf16, table, t0, t1, num_q_heads, num_kv_heads,
                      head_dim, block_size, scale, acc, m, l, scores);
        return;
    }
#endif
    if (is_bf16)
        attend_bf16(q, qb, k_cache, v_cache, table, t0, t1, num_q_heads, num_kv_heads,
                    head_dim, block_size, scale, acc, m, l, scores);
    else
        attend_f32(q, NULL, k_cache, v_cache, table, t0, t1, num_q_heads, num_kv_heads,
                   head_dim, block_size, scale, acc, m, l, scores);
}

/* One sequence's query, as float32 (q rows may be bfloat16 and strided: read in place). */
static void load_query(const void *q, int q_is_bf16, int64_t q_row_stride, int seq,
                       int num_q_heads, int head_dim, float *dst) {
    for (int h = 0; h < num_q_heads; h++) {
        const int64_t src = (int64_t)seq * q_row_stride + (int64_t)h * head_dim;
        float *d = dst + (int64_t)h * head_dim;
        if (q_is_bf16) {
            const uint16_t *qs = (const uint16_t *)q + src;
            for (int i = 0; i < head_dim; i++) d[i] = bf16_to_f32(qs[i]);
        } else {
            memcpy(d, (const float *)q + src, sizeof(float) * (size_t)head_dim);
        }
    }
}

/* out row of one sequence = acc / l per head, stored as float32 or bfloat16 */
static void store_output(const float *acc, const float *l, void *out, int out_is_bf16, int seq,
                         int num_q_heads, int head_dim) {
    const int64_t hd = (int64_t)num_q_heads * head_dim;
    for (int h = 0; h < num_q_heads; h++) {
        const float inv = 1.0f / l[h];
        const float *a = acc + (int64_t)h * head_dim;
        if (out_is_bf16) {
            uint16_t *o = (uint16_t *)out + seq * hd + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(a[d] * inv);
        } else {
            float *o = (float *)out + seq * hd + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] = a[d] * inv;
        }
    }
}

/* The first key a sequence of len keys attends: len - window with a sliding window of
 * window keys (window > 0), else 0. Keys before it are never read, nor are the pages that
 * hold only such keys (the tasks start at it, and a task reads the pages of its keys). */
static inline int64_t first_key(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* A chunk of one sequence: keys [t0, t1); part indexes its partial results (-1: the
 * sequence is one chunk, normalized straight into out). */
typedef struct {
    int seq, part;
    int64_t t0, t1;
} Task;

/* q [num_seqs, num_q_heads, head_dim] float32 or bfloat16 (q_is_bf16), heads contiguous, rows
 * q_row_stride elements apart; out [num_seqs, num_q_heads, head_dim] contiguous, float32 or
 * bfloat16 (out_is_bf16). window > 0: a sliding window, each query attends only its
 * sequence's last window keys; 0: every key. When k_new is not NULL, each sequence's new key and value rows
 * (num_kv_heads * head_dim contiguous elements of the page dtype, rows new_row_stride_k /
 * new_row_stride_v elements apart) are first written to its slot (slots[s], a flat
 * block * block_size + offset index), so the attention sees them. Returns 0, or -1 when a
 * scratch buffer could not be allocated (nothing attended then). */
int kvscope_paged_decode(const void *q, int64_t q_row_stride, int q_is_bf16, void *k_cache,
                         void *v_cache, int is_bf16, const void *k_new, const void *v_new,
                         int64_t new_row_stride_k, int64_t new_row_stride_v,
                         const int64_t *slots, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *seq_lens, int num_seqs,
                         int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale, int64_t window, void *out, int out_is_bf16,
                         int num_threads) {
    const int64_t hd = (int64_t)num_q_heads * head_dim;
    const int64_t width = (int64_t)num_kv_heads * head_dim;
    const size_t elem = is_bf16 ? 2 : 4;
    if (num_seqs <= 0) return 0; /* nothing to attend (and no zero-thread parallel region) */
    if (k_new != NULL) {
        for (int s = 0; s < num_seqs; s++) {
            memcpy((char *)k_cache + slots[s] * width * (int64_t)elem,
                   (const char *)k_new + s * new_row_stride_k * (int64_t)elem,
                   (size_t)width * elem);
            memcpy((char *)v_cache + slots[s] * width * (int64_t)elem,
                   (const char *)v_new + s * new_row_stride_v * (int64_t)elem,
                   (size_t)width * elem);
        }
    }
    /* Fewer sequences than threads: cut each long one into key chunks (split-K) so every
     * thread works; a chunk keeps at least MIN_CHUNK keys, below which the merge and the
     * fork cost more than they save. */
    enum { MIN_CHUNK = 128 };
    const int want = num_seqs < num_threads ? (num_threads + num_seqs - 1) / num_seqs : 1;
    int64_t num_tasks = 0, num_parts = 0, max_len = 1;
    for (int s = 0; s < num_seqs; s++) {
        int64_t c = (seq_lens[s] - first_key(seq_lens[s], window)) / MIN_CHUNK;
        c = c < want ? c : want;
        num_tasks += c > 1 ? c : 1;
        num_parts += c > 1 ? c : 0;
    }
    Task *tasks = malloc(sizeof(Task) * (size_t)num_tasks);
    float *parts = malloc(sizeof(float) * (size_t)(num_parts * (hd + 2 * num_q_heads) + 1));
    if (!tasks || !parts) {
        free(tasks);
        free(parts);
        return -1;
    }
    int64_t i = 0, part = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t lo = first_key(seq_lens[s], window), len = seq_lens[s] - lo;
        int64_t c = len / MIN_CHUNK;
        c = c < want ? c : want;
        if (c <= 1) {
            tasks[i++] = (Task){s, -1, lo, lo + len};
            max_len = len > max_len ? len : max_len;
            continue;
        }
        for (int64_t j = 0; j < c; j++) {
            tasks[i++] = (Task){s, (int)part++, lo + len * j / c, lo + len * (j + 1) / c};
            const int64_t n = len * (j + 1) / c - len * j / c;
            max_len = n > max_len ? n : max_len;
        }
    }
    int failed = 0;
    /* one thread's work is a few µs for short contexts: do not wake the others for it */
    const int threads = num_tasks < num_threads ? (int)num_tasks : num_threads;

#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * max_len));
        float *qf = malloc(sizeof(float) * (size_t)hd);
        float *acc = malloc(sizeof(float) * (size_t)(hd + 2 * num_q_heads));
        if (!scores || !qf || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < num_tasks; k++) {
            if (failed) continue;
            const Task tk = tasks[k];
            const int64_t *table = block_tables + tk.seq * table_stride;
            load_query(q, q_is_bf16, q_row_stride, tk.seq, num_q_heads, head_dim, qf);
            /* a bfloat16 query over bfloat16 pages: dot products in bfloat16 hardware */
            const uint16_t *qb = HAVE_DP_BF16 && q_is_bf16 && is_bf16 && head_dim % 32 == 0
                                     ? (const uint16_t *)q + tk.seq * q_row_stride
                                     : NULL;
            float *dst = tk.part < 0 ? acc : parts + tk.part * (hd + 2 * num_q_heads);
            attend(qf, qb, k_cache, v_cache, is_bf16, table, tk.t0, tk.t1, num_q_heads,
                   num_kv_heads, head_dim, block_size, scale, dst, dst + hd,
                   dst + hd + num_q_heads, scores);
            if (tk.part < 0)
                store_output(acc, acc + hd + num_q_heads, out, out_is_bf16, tk.seq,
                             num_q_heads, head_dim);
        }
        free(scores);
        free(qf);
        free(acc);
    }
    /* merge each split sequence's chunks: rescale to the common max, then normalize */
    float *merged = failed ? NULL : malloc(sizeof(float) * (size_t)(hd + num_q_heads));
    if (!failed && !merged) failed = 1;
    for (int64_t k = 0; k < num_tasks && !failed;) {
        const Task first = tasks[k];
        int64_t e = k;
        while (e < num_tasks && tasks[e].seq == first.seq) e++;
        if (first.part >= 0) {
            float *l = merged + hd;
            for (int h = 0; h < num_q_heads; h++) {
                float mh = -INFINITY, total = 0.0f;
                for (int64_t j = k; j < e; j++) {
                    const float *p = parts + tasks[j].part * (hd + 2 * num_q_heads);
                    mh = p[hd + h] > mh ? p[hd + h] : mh;
                }
                float *oh = merged + (int64_t)h * head_dim;
                memset(oh, 0, sizeof(float) * (size_t)head_dim);
                for (int64_t j = k; j < e; j++) {
                    const float *p = parts + tasks[j].part * (hd + 2 * num_q_heads);
                    const float w = expf(p[hd + h] - mh);
                    total += w * p[hd + num_q_heads + h];
                    for (int d = 0; d < head_dim; d++) oh[d] += w * p[(int64_t)h * head_dim + d];
                }
                l[h] = total;
            }
            store_output(merged, l, out, out_is_bf16, first.seq, num_q_heads, head_dim);
        }
        k = e;
    }
    free(merged);
    free(tasks);
    free(parts);
    return failed ? -1 : 0;
}
