/* Paged decode attention for the CPU: each query reads its sequence's K/V rows where they
 * lie in the paged cache (no gathered copy), accumulating in float32 from float32 or
 * bfloat16 pages (no widened copy of the cache).
 *
 * Layout (kernels.reference's): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
 * head_dim], contiguous; q [num_seqs, num_q_heads, head_dim] float32; block_tables
 * [num_seqs, table_stride] int64; seq_lens [num_seqs] int64; out like q. Query head h reads
 * kv head h / (num_q_heads / num_kv_heads) (GQA). The caller validated every length and
 * block id (kernels.cpu_attention.StepPlan does, once per step): this file trusts them.
 *
 * One task per sequence, split over OpenMP threads: a token's row (all kv heads) is read
 * once, front to back through the pages. Two passes: scores for every key, then softmax
 * weights times V. Not split by kv head when sequences are few: each task would read a
 * third of every row with a stride, measured slower in the engine step than the torch
 * gather path once the pages come from DRAM (docs/BENCHMARKS.md, issue 22); a long single
 * sequence therefore runs on one thread (split-K over the token range is the way to use
 * more).
 * Built by kernels/cpu_native.py with the C compiler at first use; linked against the
 * process's already-loaded libgomp (torch's), so there is one OpenMP thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The row of one cached token: num_kv_heads * head_dim values, as float32 (converted into
 * dst when the pages are bfloat16). */
static inline const float *load_row(const void *cache, int is_bf16, int64_t slot, int width,
                                    float *dst) {
    if (!is_bf16) return (const float *)cache + slot * width;
    /* bfloat16 is the top half of a float32: widen by a shift (built with
     * -fno-strict-aliasing, so the float buffer may be written as uint32) */
    const uint16_t *src = (const uint16_t *)cache + slot * width;
    uint32_t *bits = (uint32_t *)dst;
#pragma omp simd
    for (int d = 0; d < width; d++) bits[d] = (uint32_t)src[d] << 16;
    return dst;
}

/* One task: one sequence's query heads [0, num_q_heads) over its len keys. */
static void attend(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                   const int64_t *table, int64_t len, int num_q_heads, int num_kv_heads,
                   int head_dim, int block_size, float scale, float *out, float *scores,
                   float *row) {
    const int group = num_q_heads / num_kv_heads, width = num_kv_heads * head_dim;
    /* pass 1: scores[h][t] = scale * <q_h, k_t>, reading each token's row once, in page
     * order (a page is block_size consecutive rows) */
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float *k = load_row(k_cache, is_bf16, slot, width, row);
        for (int h = 0; h < num_q_heads; h++) {
            const float *qh = q + (int64_t)h * head_dim, *kh = k + (int64_t)(h / group) * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
            scores[(int64_t)h * len + t] = dot * scale;
        }
    }
    /* softmax per head, in place */
    for (int h = 0; h < num_q_heads; h++) {
        float *sh = scores + (int64_t)h * len;
        float m = sh[0];
        for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
        float total = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            sh[t] = expf(sh[t] - m);
            total += sh[t];
        }
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < len; t++) sh[t] *= inv;
    }
    /* pass 2: out_h = sum_t p[h][t] * v_t */
    memset(out, 0, sizeof(float) * (size_t)(num_q_heads * head_dim));
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float *v = load_row(v_cache, is_bf16, slot, width, row);
        for (int h = 0; h < num_q_heads; h++) {
            const float p = scores[(int64_t)h * len + t];
            const float *vh = v + (int64_t)(h / group) * head_dim;
            float *ah = out + (int64_t)h * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) ah[d] += p * vh[d];
        }
    }
}

int kvscope_paged_decode(const float *q, const void *k_cache, const void *v_cache,
                         int is_bf16, const int64_t *block_tables, int64_t table_stride,
                         const int64_t *seq_lens, int num_seqs, int num_q_heads,
                         int num_kv_heads, int head_dim, int block_size, float scale,
                         float *out, int num_threads) {
    /* A task is a whole sequence, its rows read front to back (file comment). */
    const int64_t tasks = num_seqs;
    int64_t max_len = 1;
    for (int s = 0; s < num_seqs; s++)
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * max_len));
        float *row = malloc(sizeof(float) * (size_t)(num_kv_heads * head_dim));
        if (!scores || !row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed) continue;
            const int64_t s = task, seq_q = s * num_q_heads * head_dim;
            attend(q + seq_q, k_cache, v_cache, is_bf16, block_tables + s * table_stride,
                   seq_lens[s], num_q_heads, num_kv_heads, head_dim, block_size, scale,
                   out + seq_q, scores, row);
        }
        free(scores);
        free(row);
    }
    return failed ? -1 : 0;
}
