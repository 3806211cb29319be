/* The AVX-512 inner loops of kernels/cpu_paged_decode.c, for the head sizes the engine's
 * models use (64 and 128): one sequence's attention over a run of rows in one page.
 *
 * Why not the portable loops: at a hundred sequences the portable kernel ran at a third
 * of the memory bandwidth (docs/BENCHMARKS.md, issue 22). It was bound by instructions:
 * every (token, query head) dot product reloaded its query, reloaded the key row once per
 * query head of the kv group, and paid a 16-lane horizontal sum; every (token, head) of the
 * P·V pass loaded and stored its accumulator. Here a kv head's query heads (up to HMAX)
 * stay in registers while its key rows stream past, each key vector feeds every query head
 * of the group, four tokens' sums are reduced together (hsum4), and the output
 * accumulators stay in registers across a page's rows.
 *
 * Results differ from the portable loops only by float32 summation order.
 * Included by cpu_paged_decode.c only; the build cache key hashes this file. */
#ifndef KVSCOPE_CPU_DECODE_AVX512_H
#define KVSCOPE_CPU_DECODE_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: the 16-lane sums of four vectors in 9 shuffles
 * and adds, where four separate reductions take 16 */
ALWAYS_INLINE __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* per 128-bit lane: [a0 0+2, a1 0+2, a0 1+3, a1 1+3] and the same for a2, a3 */
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    /* per 128-bit lane: [a0, a1, a2, a3] partial sums */
    const __m512d t0d = _mm512_castps_pd(t0), t1d = _mm512_castps_pd(t1);
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0d, t1d)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(t0d, t1d)));
    const __m256 h = _mm256_add_ps(
        _mm512_castps512_ps256(u),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* 16 elements of a page row as float32 */
ALWAYS_INLINE __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE __m512 load16_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Query heads per register-resident pass: H heads of DV vectors plus four tokens' H
 * accumulators must fit the 32 vector registers. */
#define HMAX(DV) ((DV) <= 4 ? 3 : 2)

/* Pass 1 over `rows` consecutive page rows (row r at k + r * width, this kv head's slice):
 * s[h * n + r] = scale * <q_h, k_r> for the H query heads at q (head_dim = 16 * DV apart).
 * T/LOAD: the page element type and its widening load. */
#define DEFINE_SCORES(NAME, T, LOAD)                                                          \
    ALWAYS_INLINE void NAME(const float *q, const T *k, int64_t width, int rows, float scale, \
                            float *s, int64_t n, const int DV, const int H) {                 \
        __m512 qv[3][8];                                                                      \
        _Pragma("GCC unroll 3") for (int h = 0; h < H; h++)                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++)                              \
                qv[h][j] = _mm512_loadu_ps(q + h * 16 * DV + 16 * j);                         \
        const __m128 sc4 = _mm_set1_ps(scale);                                                \
        int r = 0;                                                                            \
        for (; r + 4 <= rows; r += 4) {                                                       \
            __m512 a[4][3];                                                                   \
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++)                               \
                _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) a[t][h] =                 \
                    _mm512_setzero_ps();                                                      \
            _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++)                              \
                _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {                         \
                const __m512 kv = LOAD(k + (int64_t)(r + t) * width + 16 * j);                \
                _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) a[t][h] =                 \
                    _mm512_fmadd_ps(qv[h][j], kv, a[t][h]);                                   \
            }                                                                                 \
            _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) _mm_storeu_ps(                \
                s + h * n + r,                                                                \
                _mm_mul_ps(sc4, hsum4(a[0][h], a[1][h], a[2][h], a[3][h])));                  \
        }                                                                                     \
        for (; r < rows; r++) {                                                               \
            __m512 a[3];                                                                      \
            _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) a[h] = _mm512_setzero_ps();   \
            _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++) {                            \
                const __m512 kv = LOAD(k + (int64_t)r * width + 16 * j);                      \
                _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) a[h] =                    \
                    _mm512_fmadd_ps(qv[h][j], kv, a[h]);                                      \
            }                                                                                 \
            _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) s[h * n + r] =                \
                scale * _mm512_reduce_add_ps(a[h]);                                           \
        }                                                                                     \
    }

/* Pass 2 over the same rows: acc_h += sum_r p[h * n + r] * v_r for the H heads whose
 * accumulators are at acc (head_dim apart), kept in registers across the rows. */
#define DEFINE_WEIGHTED_SUM(NAME, T, LOAD)                                                    \
    ALWAYS_INLINE void NAME(const float *p, int64_t n, const T *v, int64_t width, int rows,   \
                            float *acc, const int DV, const int H) {                          \
        __m512 av[3][8];                                                                      \
        _Pragma("GCC unroll 3") for (int h = 0; h < H; h++)                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++)                              \
                av[h][j] = _mm512_loadu_ps(acc + h * 16 * DV + 16 * j);                       \
        for (int r = 0; r < rows; r++) {                                                      \
            __m512 w[3];                                                                      \
            _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) w[h] =                        \
                _mm512_set1_ps(p[h * n + r]);                                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++) {                            \
                const __m512 vv = LOAD(v + (int64_t)r * width + 16 * j);                      \
                _Pragma("GCC unroll 3") for (int h = 0; h < H; h++) av[h][j] =                \
                    _mm512_fmadd_ps(w[h], vv, av[h][j]);                                      \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 3") for (int h = 0; h < H; h++)                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++)                              \
                _mm512_storeu_ps(acc + h * 16 * DV + 16 * j, av[h][j]);                       \
    }

DEFINE_SCORES(scores_f32, float, load16_f32)
DEFINE_SCORES(scores_bf16, uint16_t, load16_bf16)
DEFINE_WEIGHTED_SUM(wsum_f32, float, load16_f32)
DEFINE_WEIGHTED_SUM(wsum_bf16, uint16_t, load16_bf16)

/* Calls FN(args..., DV, H) with DV and H as constants, so each (head size, heads per pass)
 * pair compiles to its own fully unrolled loop. */
#define DISPATCH_DV_H(FN, DV, H, ...)                                                         \
    do {                                                                                      \
        if ((DV) == 4) {                                                                      \
            if ((H) == 3) FN(__VA_ARGS__, 4, 3);                                              \
            else if ((H) == 2) FN(__VA_ARGS__, 4, 2);                                         \
            else FN(__VA_ARGS__, 4, 1);                                                       \
        } else {                                                                              \
            if ((H) == 2) FN(__VA_ARGS__, 8, 2);                                              \
            else FN(__VA_ARGS__, 8, 1);                                                       \
        }                                                                                     \
    } while (0)

/* Ask for the rows of the page holding key t (up to t1) while the current page is being
 * read: pages lie anywhere, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_page(const void *cache, int is_bf16, const int64_t *table, int64_t t,
                                 int64_t t1, int64_t width, int block_size) {
    const int64_t off = t % block_size;
    const int64_t rows = block_size - off < t1 - t ? block_size - off : t1 - t;
    const int64_t elem = is_bf16 ? 2 : 4;
    const char *p = (const char *)cache + (table[t / block_size] * block_size + off) * width * elem;
    for (int64_t b = 0; b < rows * width * elem; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* Whether attend_avx512 takes this shape. */
static inline int avx512_decode_takes(int head_dim) { return head_dim == 64 || head_dim == 128; }

/* One task as DEFINE_ATTEND in cpu_paged_decode.c (same arguments and results, float32
 * query; pages float32 or bfloat16), page by page: a page's rows stay in L1 while each kv
 * head's query heads pass over them. Requires avx512_decode_takes(head_dim). */
static void attend_avx512(const float *q, const void *k_cache, const void *v_cache,
                          int is_bf16, const int64_t *table, int64_t t0, int64_t t1,
                          int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, float *acc, float *m, float *l, float *scores) {
    const int group = num_q_heads / num_kv_heads, DV = head_dim / 16;
    const int hmax = HMAX(DV);
    const int64_t width = (int64_t)num_kv_heads * head_dim, n = t1 - t0;
    for (int64_t t = t0; t < t1;) {
        const int64_t off = t % block_size;
        const int rows = (int)(block_size - off < t1 - t ? block_size - off : t1 - t);
        const int64_t row0 = (table[t / block_size] * block_size + off) * width;
        if (t + rows < t1) prefetch_page(k_cache, is_bf16, table, t + rows, t1, width, block_size);
        for (int g = 0; g < num_kv_heads; g++)
            for (int h0 = 0; h0 < group; h0 += hmax) {
                const int H = group - h0 < hmax ? group - h0 : hmax, h = g * group + h0;
                float *s = scores + (int64_t)h * n + (t - t0);
                if (is_bf16) {
                    const uint16_t *k = (const uint16_t *)k_cache + row0 + g * head_dim;
                    DISPATCH_DV_H(scores_bf16, DV, H, q + h * head_dim, k, width, rows, scale,
                                  s, n);
                } else {
                    const float *k = (const float *)k_cache + row0 + g * head_dim;
                    DISPATCH_DV_H(scores_f32, DV, H, q + h * head_dim, k, width, rows, scale,
                                  s, n);
                }
            }
        t += rows;
    }
    /* exp(s - max) per head, in place */
    for (int h = 0; h < num_q_heads; h++) {
        float *sh = scores + (int64_t)h * n;
        __m512 mv = _mm512_set1_ps(sh[0]);
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sh + t));
        float mh = _mm512_reduce_max_ps(mv);
        for (; t < n; t++) mh = sh[t] > mh ? sh[t] : mh;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < n; i++) {
            sh[i] = expf(sh[i] - mh);
            total += sh[i];
        }
        m[h] = mh;
        l[h] = total;
    }
    memset(acc, 0, sizeof(float) * (size_t)(num_q_heads * head_dim));
    /* (the page walk is written out again, as in pass 1: a shared page_run() helper measured
     * 30-40% slower in bf16 with gcc 12, twice, in alternating runs of bench_cpu_decode.py) */
    for (int64_t t = t0; t < t1;) {
        const int64_t off = t % block_size;
        const int rows = (int)(block_size - off < t1 - t ? block_size - off : t1 - t);
        const int64_t row0 = (table[t / block_size] * block_size + off) * width;
        if (t + rows < t1) prefetch_page(v_cache, is_bf16, table, t + rows, t1, width, block_size);
        for (int g = 0; g < num_kv_heads; g++)
            for (int h0 = 0; h0 < group; h0 += hmax) {
                const int H = group - h0 < hmax ? group - h0 : hmax, h = g * group + h0;
                const float *p = scores + (int64_t)h * n + (t - t0);
                float *a = acc + (int64_t)h * head_dim;
                if (is_bf16) {
                    const uint16_t *v = (const uint16_t *)v_cache + row0 + g * head_dim;
                    DISPATCH_DV_H(wsum_bf16, DV, H, p, n, v, width, rows, a);
                } else {
                    const float *v = (const float *)v_cache + row0 + g * head_dim;
                    DISPATCH_DV_H(wsum_f32, DV, H, p, n, v, width, rows, a);
                }
            }
        t += rows;
    }
}

#endif
