/* Paged prefill attention for the CPU: causal attention of a step's prompt chunks over their
 * sequences' keys (any cached context plus the chunk itself), reading K/V from the paged
 * cache, as flash-attention tiles with float32 accumulation.
 *
 * Layout (kernels.reference's): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
 * head_dim], contiguous, float32 or bfloat16; q [T, num_q_heads, head_dim] of the page dtype,
 * heads contiguous, rows q_row_stride elements apart (views into the fused qkv are read in
 * place); out [T, num_q_heads, head_dim] contiguous, float32 or bfloat16. Prefill s owns
 * query rows q_starts[s] .. q_starts[s] + q_lens[s]; its query i (0-based in the chunk) sees
 * keys < seq_lens[s] - q_lens[s] + i + 1 (the context, then causal); with a sliding window
 * of window > 0 keys, only the last window of those (keys >= that bound - window): no key
 * before a sequence's first query's window is read (nor packed), and a tile skips the key
 * blocks wholly before its first query's window. Query head h reads kv
 * head h / (num_q_heads / num_kv_heads) (GQA). The caller validated every length and block
 * id (kernels.cpu_attention.StepPlan does, once per step): this file trusts them.
 *
 * Why a kernel of our own: torch's CPU flash SDPA ran these shapes (9 q / 3 kv heads of 64,
 * 20-350 tokens) at 53-74 GFLOPS in float32 on the development machine, where its matmuls
 * run at 200 (float32) and 900 (bfloat16, AVX512-BF16) GFLOPS, and a chunk with cached
 * context took its masked (non-flash) path over a gathered copy of the pages.
 *
 * Two phases per call, both split over OpenMP threads:
 *   1. pack: every (prefill, kv head) has its keys packed in blocks of BK keys in the order
 *      the tile loops read them: K transposed (float32: [head_dim][BK]; bfloat16: [head_dim/2]
 *      [BK] words, a word being two consecutive dims, as vdpbf16ps pairs them), V as rows
 *      (float32: [BK][head_dim]; bfloat16: [BK/2][head_dim] words pairing two consecutive
 *      keys). Keys past the sequence are zeros (masked anyway). Packed once per call, read
 *      by every query tile of the sequence;
 *   2. tiles: one task per (prefill, kv head, BQ query positions), its rows being each
 *      position's query heads of that kv head; per key block Q.K^T, an online softmax (max,
 *      rescale, sum) and P.V for RB rows at a time in registers.
 * Numerics: bfloat16 computes <q, k> with exact products summed in float32 (vdpbf16ps); the
 * softmax weights are rounded to bfloat16 for P.V (as GPU flash attention does for bfloat16)
 * and the row sum is taken over the rounded weights, so each output row stays an exact
 * convex combination of V rows up to float32 sums. float32 uses FMAs throughout.
 * Needs AVX-512 (F, BW; and BF16 for bfloat16): kvscope_paged_prefill_supported says
 * whether this build can run a given call; the caller takes torch's path when it cannot.
 * Built by kernels/cpu_native.py with the C compiler at first use, sharing torch's libgomp.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_DP_BF16 1
#else
#define HAVE_DP_BF16 0
#endif

#if HAVE_AVX512 && defined(__GLIBC__)
/* glibc's 16-lane expf (libmvec, the symbol gcc calls for a vectorized expf) */
__m512 _ZGVeN16v_expf(__m512);
#define exp16 _ZGVeN16v_expf
#elif HAVE_AVX512
static inline __m512 exp16(__m512 x) {
    float t[16];
    _mm512_storeu_ps(t, x);
    for (int i = 0; i < 16; i++) t[i] = expf(t[i]);
    return _mm512_loadu_ps(t);
}
#endif

/* Keep a loaded vector in a register: without this gcc folds the load into every FMA that
 * uses it (a memory operand each), and the loads, not the FMAs, bound the loop. */
#define IN_REGISTER(x) __asm__("" : "+v"(x))

enum {
    BK = 32, /* keys per block */
    BQ = 16, /* query positions per tile */
    RB = 4,  /* tile rows computed together in registers */
};


int kvscope_paged_prefill_supported(int is_bf16, int head_dim) {
    if (!HAVE_AVX512 || head_dim <= 0 || head_dim % 64 != 0 || head_dim > 512) return 0;
    return is_bf16 ? HAVE_DP_BF16 : 1;
}

#if HAVE_AVX512

/* ---- microkernels: RB rows x one key block -------------------------------------------- */

/* S[r][j] = <q_r, k_j> for RB float32 rows (q, row stride head_dim) over Kt [head_dim][BK]. */
static inline void qk_f32(const float *q, const float *kt, int head_dim, float s[RB][BK]) {
    __m512 a[RB][2];
    for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        __m512 k0 = _mm512_loadu_ps(kt + d * BK), k1 = _mm512_loadu_ps(kt + d * BK + 16);
        IN_REGISTER(k0);
        IN_REGISTER(k1);
        for (int r = 0; r < RB; r++) {
            const __m512 x = _mm512_set1_ps(q[r * head_dim + d]);
            a[r][0] = _mm512_fmadd_ps(x, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(x, k1, a[r][1]);
        }
    }
    for (int r = 0; r < RB; r++) {
        _mm512_storeu_ps(s[r], a[r][0]);
        _mm512_storeu_ps(s[r] + 16, a[r][1]);
    }
}

/* o_r = o_r * corr_r + sum_j p[r][j] v_j for RB rows over V [BK][head_dim] float32. */
static inline void pv_f32(const float p[RB][BK], const float *v, const float *corr, float *o,
                          int head_dim) {
    for (int d0 = 0; d0 < head_dim; d0 += 64) {
        __m512 a[RB][4];
        for (int r = 0; r < RB; r++)
            for (int x = 0; x < 4; x++) a[r][x] = _mm512_setzero_ps();
        for (int j = 0; j < BK; j++) {
            const float *vj = v + j * head_dim + d0;
            __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16),
                   v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
            IN_REGISTER(v0);
            IN_REGISTER(v1);
            IN_REGISTER(v2);
            IN_REGISTER(v3);
            for (int r = 0; r < RB; r++) {
                const __m512 w = _mm512_set1_ps(p[r][j]);
                a[r][0] = _mm512_fmadd_ps(w, v0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(w, v1, a[r][1]);
                a[r][2] = _mm512_fmadd_ps(w, v2, a[r][2]);
                a[r][3] = _mm512_fmadd_ps(w, v3, a[r][3]);
            }
        }
        for (int r = 0; r < RB; r++) {
            const __m512 c = _mm512_set1_ps(corr[r]);
            for (int x = 0; x < 4; x++) {
                float *dst = o + r * head_dim + d0 + 16 * x;
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), c, a[r][x]));
            }
        }
    }
}

#if HAVE_DP_BF16
/* S[r][j] = <q_r, k_j> for RB bfloat16 rows (as words, row stride head_dim / 2) over
 * Kp [head_dim / 2][BK] words: exact products, float32 sums. */
static inline void qk_bf16(const uint32_t *q, const uint32_t *kp, int words, float s[RB][BK]) {
    __m512 a[RB][2];
    for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int w = 0; w < words; w++) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + w * BK),
                 k1 = (__m512bh)_mm512_loadu_si512(kp + w * BK + 16);
        IN_REGISTER(k0);
        IN_REGISTER(k1);
        for (int r = 0; r < RB; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)q[r * words + w]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], x, k0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], x, k1);
        }
    }
    for (int r = 0; r < RB; r++) {
        _mm512_storeu_ps(s[r], a[r][0]);
        _mm512_storeu_ps(s[r] + 16, a[r][1]);
    }
}

/* o_r = o_r * corr_r + sum_j p_rj v_j for RB rows: p as bfloat16 pairs of consecutive keys
 * (pw [RB][BK / 2] words), V as Vp [BK / 2][head_dim] words pairing those keys. */
static inline void pv_bf16(const uint32_t pw[RB][BK / 2], const uint32_t *vp,
                           const float *corr, float *o, int head_dim) {
    for (int d0 = 0; d0 < head_dim; d0 += 64) {
        __m512 a[RB][4];
        for (int r = 0; r < RB; r++)
            for (int x = 0; x < 4; x++) a[r][x] = _mm512_setzero_ps();
        for (int jp = 0; jp < BK / 2; jp++) {
            const uint32_t *vj = vp + jp * head_dim + d0;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(vj),
                     v1 = (__m512bh)_mm512_loadu_si512(vj + 16),
                     v2 = (__m512bh)_mm512_loadu_si512(vj + 32),
                     v3 = (__m512bh)_mm512_loadu_si512(vj + 48);
            IN_REGISTER(v0);
            IN_REGISTER(v1);
            IN_REGISTER(v2);
            IN_REGISTER(v3);
            for (int r = 0; r < RB; r++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[r][jp]);
                a[r][0] = _mm512_dpbf16_ps(a[r][0], w, v0);
                a[r][1] = _mm512_dpbf16_ps(a[r][1], w, v1);
                a[r][2] = _mm512_dpbf16_ps(a[r][2], w, v2);
                a[r][3] = _mm512_dpbf16_ps(a[r][3], w, v3);
            }
        }
        for (int r = 0; r < RB; r++) {
            const __m512 c = _mm512_set1_ps(corr[r]);
            for (int x = 0; x < 4; x++) {
                float *dst = o + r * head_dim + d0 + 16 * x;
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), c, a[r][x]));
            }
        }
    }
}
#endif /* HAVE_DP_BF16 */

/* The online softmax of RB rows over one key block: s holds the raw scores, row r sees
 * the block's keys whose bits are set in vis[r] (a run of consecutive keys). Updates each row's running max m and sum l, and writes corr
 * (the factor for the row's output so far: exp(old max - new max); 1 for a row that sees no
 * key here, which keeps its state) and the weights exp(score - max): float32 in p, or
 * rounded to bfloat16 as pairs of consecutive keys in pw (as pv_bf16 reads them; the row
 * sum is then taken over the rounded weights). */
static inline void softmax_rows(const float s[RB][BK], const uint32_t vis[RB], float scale,
                                int is_bf16, float *m, float *l, float corr[RB],
                                float p[RB][BK], uint32_t pw[RB][BK / 2]) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sc_v = _mm512_set1_ps(scale);
    __m512 x[RB][2];
    float mx[RB], diff[16] = {0};
    for (int r = 0; r < RB; r++) {
        /* scaled scores, -inf on every key the row does not see (exp gives 0 there) */
        const __mmask16 lo = (__mmask16)(vis[r] & 0xFFFFu), hi = (__mmask16)(vis[r] >> 16);
        x[r][0] = _mm512_mask_mul_ps(ninf, lo, _mm512_loadu_ps(s[r]), sc_v);
        x[r][1] = _mm512_mask_mul_ps(ninf, hi, _mm512_loadu_ps(s[r] + 16), sc_v);
        const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(x[r][0], x[r][1]));
        mx[r] = vis[r] == 0 || m[r] > block_max ? m[r] : block_max;
        diff[r] = vis[r] == 0 ? 0.0f : m[r] - mx[r]; /* -inf on a row's first keys: corr 0 */
    }
    float c[16];
    _mm512_storeu_ps(c, exp16(_mm512_loadu_ps(diff))); /* the RB corrections in one call */
    for (int r = 0; r < RB; r++) {
        corr[r] = c[r];
        const __m512 mv = _mm512_set1_ps(vis[r] == 0 ? 0.0f : mx[r]);
        const __m512 e0 = exp16(_mm512_sub_ps(x[r][0], mv)),
                     e1 = exp16(_mm512_sub_ps(x[r][1], mv));
        float total;
#if HAVE_DP_BF16
        if (is_bf16) {
            /* round to nearest even, in key order: word jp holds keys 2jp and 2jp + 1 */
            const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
            _mm512_storeu_si512(pw[r], w);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            const __m512 odd =
                _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
            total = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
        } else
#endif
        {
            (void)is_bf16, (void)pw;
            _mm512_storeu_ps(p[r], e0);
            _mm512_storeu_ps(p[r] + 16, e1);
            total = _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        }
        if (vis[r] != 0) {
            l[r] = l[r] * corr[r] + total;
            m[r] = mx[r];
        }
    }
}

/* ---- phase 1: packing ------------------------------------------------------------------ */

typedef struct {
    const int64_t *table;
    int64_t seq_len, q_start, q_len;
    int64_t packed;     /* index of this sequence's first packed block (kv head 0, key block
                           kb0) */
    int64_t kb0;        /* its first packed key block: the one holding its first query's
                           window's first key (0 without a window) */
    int64_t key_blocks; /* packed per kv head: key blocks kb0 .. kb0 + key_blocks */
    int64_t window;     /* > 0: a sliding window of this many keys; 0: none */
    int64_t from;       /* its first query's window's first key: no key before it is read
                           (packed as zeros, never visible) */
} Seq;

/* Key block kb of (sequence, kv head g) packed into kdst / vdst (layouts in the header). */
static void pack_block(const Seq *sq, int g, int64_t kb, const void *k_cache,
                       const void *v_cache, int is_bf16, int num_kv_heads, int head_dim,
                       int block_size, void *kdst, void *vdst) {
    const size_t elem = is_bf16 ? 2 : 4;
    const void *krow[BK], *vrow[BK];
    for (int j = 0; j < BK; j++) {
        const int64_t t = kb * BK + j;
        if (t >= sq->seq_len || t < sq->from) {
            krow[j] = vrow[j] = NULL;
            continue;
        }
        const int64_t at = ((sq->table[t / block_size] * block_size + t % block_size) *
                                num_kv_heads + g) * head_dim * (int64_t)elem;
        krow[j] = (const char *)k_cache + at;
        vrow[j] = (const char *)v_cache + at;
    }
    if (is_bf16) {
        const int words = head_dim / 2;
        uint32_t *kp = kdst, *vp = vdst;
        for (int j = 0; j < BK; j++) {
            const uint32_t *k = krow[j];
            for (int w = 0; w < words; w++) kp[w * BK + j] = k ? k[w] : 0;
        }
        for (int jp = 0; jp < BK / 2; jp++) {
            const uint16_t *v0 = vrow[2 * jp], *v1 = vrow[2 * jp + 1];
            uint32_t *dst = vp + jp * head_dim;
            for (int d = 0; d < head_dim; d++)
                dst[d] = (uint32_t)(v0 ? v0[d] : 0) | (uint32_t)(v1 ? v1[d] : 0) << 16;
        }
    } else {
        float *kt = kdst, *vb = vdst;
        for (int j = 0; j < BK; j++) {
            const float *k = krow[j], *v = vrow[j];
            for (int d = 0; d < head_dim; d++) kt[d * BK + j] = k ? k[d] : 0.0f;
            if (v)
                memcpy(vb + j * head_dim, v, sizeof(float) * (size_t)head_dim);
            else
                memset(vb + j * head_dim, 0, sizeof(float) * (size_t)head_dim);
        }
    }
}

/* ---- phase 2: one query tile ----------------------------------------------------------- */

typedef struct {
    int seq, kv_head;
    int64_t i0, i1; /* query positions [i0, i1) of the chunk */
    int64_t cost;   /* keys its last position sees */
} Tile;

typedef struct { /* one thread's scratch */
    void *q;     /* [rows][head_dim] of the page dtype */
    float *o;    /* [rows][head_dim] */
    float *m, *l;
    int64_t *lim; /* row r sees keys [first[r], lim[r]) */
    int64_t *first;
} Scratch;

static void run_tile(const Tile *tl, const Seq *sq, const void *q, int64_t q_row_stride,
                     const void *kpack, const void *vpack, int is_bf16, int num_q_heads,
                     int num_kv_heads, int head_dim, float scale, void *out, int out_is_bf16,
                     Scratch *sc) {
    const int group = num_q_heads / num_kv_heads;
    const int64_t context = sq->seq_len - sq->q_len;
    const int rows = (int)(tl->i1 - tl->i0) * group;
    const int padded = (rows + RB - 1) / RB * RB;
    const size_t elem = is_bf16 ? 2 : 4;
    const int64_t block_elems = (int64_t)BK * head_dim;
    /* rows ordered by position, then head: the row limits never decrease */
    for (int r = 0; r < padded; r++) {
        const int rr = r < rows ? r : rows - 1;
        const int64_t i = tl->i0 + rr / group;
        sc->lim[r] = context + i + 1;
        sc->first[r] = sq->window > 0 && sc->lim[r] > sq->window ? sc->lim[r] - sq->window : 0;
        char *dst = (char *)sc->q + (size_t)r * head_dim * elem;
        if (r < rows) {
            const int h = tl->kv_head * group + r % group;
            memcpy(dst,
                   (const char *)q + ((sq->q_start + i) * q_row_stride + (int64_t)h * head_dim) *
                                         (int64_t)elem,
                   (size_t)head_dim * elem);
        } else {
            memset(dst, 0, (size_t)head_dim * elem);
        }
        sc->m[r] = -INFINITY;
        sc->l[r] = 0.0f;
    }
    memset(sc->o, 0, sizeof(float) * (size_t)padded * head_dim);
    const int64_t last_key = sc->lim[padded - 1];
    /* packed block of key block kb: first + kb (the sequence's packing starts at kb0) */
    const int64_t first = sq->packed + (int64_t)tl->kv_head * sq->key_blocks - sq->kb0;
    for (int64_t kb = sc->first[0] / BK; kb * BK < last_key; kb++) {
        const int64_t k0 = kb * BK;
        const char *kblock = (const char *)kpack + (first + kb) * block_elems * (int64_t)elem;
        const char *vblock = (const char *)vpack + (first + kb) * block_elems * (int64_t)elem;
        for (int r0 = 0; r0 < padded; r0 += RB) {
            /* the whole group is masked here: every row's keys end before the block, or
             * (windows) start after it; rows' bounds never decrease */
            if (sc->lim[r0 + RB - 1] <= k0 || sc->first[r0] >= k0 + BK) continue;
            float s[RB][BK], p[RB][BK], corr[RB];
            uint32_t pw[RB][BK / 2];
#if HAVE_DP_BF16
            if (is_bf16)
                qk_bf16((const uint32_t *)sc->q + (int64_t)r0 * head_dim / 2,
                        (const uint32_t *)kblock, head_dim / 2, s);
            else
#endif
                qk_f32((const float *)sc->q + (int64_t)r0 * head_dim, (const float *)kblock,
                       head_dim, s);
            uint32_t vis[RB];
            for (int r = 0; r < RB; r++) {
                const int64_t hi = sc->lim[r0 + r] - k0, lo = sc->first[r0 + r] - k0;
                const int n = hi >= BK ? BK : hi <= 0 ? 0 : (int)hi;
                const int a = lo <= 0 ? 0 : lo >= BK ? BK : (int)lo;
                /* keys [a, n) of the block (BK == 32 bits) */
                vis[r] = a >= n ? 0u
                                : (n == 32 ? 0xFFFFFFFFu : (1u << n) - 1u) & ~((1u << a) - 1u);
            }
            softmax_rows(s, vis, scale, is_bf16, sc->m + r0, sc->l + r0, corr, p, pw);
            float *o = sc->o + (int64_t)r0 * head_dim;
#if HAVE_DP_BF16
            if (is_bf16)
                pv_bf16((const uint32_t(*)[BK / 2])pw, (const uint32_t *)vblock, corr, o,
                        head_dim);
            else
#endif
                pv_f32((const float(*)[BK])p, (const float *)vblock, corr, o, head_dim);
        }
    }
    const int64_t hd = (int64_t)num_q_heads * head_dim;
    for (int r = 0; r < rows; r++) {
        const int64_t i = tl->i0 + r / group;
        const int h = tl->kv_head * group + r % group;
        const int64_t at = (sq->q_start + i) * hd + (int64_t)h * head_dim;
        const float inv = 1.0f / sc->l[r], *src = sc->o + (int64_t)r * head_dim;
        if (out_is_bf16) {
            uint16_t *dst = (uint16_t *)out + at;
            for (int d = 0; d < head_dim; d++) dst[d] = f32_to_bf16(src[d] * inv);
        } else {
            float *dst = (float *)out + at;
            for (int d = 0; d < head_dim; d++) dst[d] = src[d] * inv;
        }
    }
}

static int by_cost_desc(const void *a, const void *b) {
    const Tile *x = a, *y = b;
    return (y->cost > x->cost) - (y->cost < x->cost);
}

#endif /* HAVE_AVX512 */

/* Attend every prefill (see the header). Returns 0; -1 when a scratch buffer could not be
 * allocated; -2 when this build cannot run the call (kvscope_paged_prefill_supported). */
int kvscope_paged_prefill(const void *q, int64_t q_row_stride, const void *k_cache,
                          const void *v_cache, int is_bf16, const int64_t *block_tables,
                          int64_t table_stride, const int64_t *q_starts, const int64_t *q_lens,
                          const int64_t *seq_lens, int num_seqs, int num_q_heads,
                          int num_kv_heads, int head_dim, int block_size, float scale,
                          int64_t window, void *out, int out_is_bf16, int num_threads) {
    if (!kvscope_paged_prefill_supported(is_bf16, head_dim)) return -2;
#if HAVE_AVX512
    if (num_seqs <= 0) return 0;
    const size_t elem = is_bf16 ? 2 : 4;
    Seq *seqs = malloc(sizeof(Seq) * (size_t)num_seqs);
    if (!seqs) return -1;
    int64_t blocks = 0, num_tiles = 0;
    for (int s = 0; s < num_seqs; s++) {
        Seq *sq = &seqs[s];
        sq->table = block_tables + s * table_stride;
        sq->seq_len = seq_lens[s];
        sq->q_start = q_starts[s];
        sq->q_len = q_lens[s];
        sq->window = window > 0 ? window : 0;
        /* the first query sees keys from context + 1 - window on (a window's first key) */
        const int64_t from = sq->seq_len - sq->q_len + 1 - sq->window;
        sq->from = sq->window > 0 && from > 0 ? from : 0;
        sq->kb0 = sq->from / BK;
        sq->key_blocks = (sq->seq_len + BK - 1) / BK - sq->kb0;
        sq->packed = blocks;
        blocks += sq->key_blocks * num_kv_heads;
        num_tiles += (sq->q_len + BQ - 1) / BQ * num_kv_heads;
    }
    const size_t block_bytes = (size_t)BK * head_dim * elem;
    void *kpack = aligned_alloc(64, block_bytes * (size_t)blocks);
    void *vpack = aligned_alloc(64, block_bytes * (size_t)blocks);
    Tile *tiles = malloc(sizeof(Tile) * (size_t)num_tiles);
    if (!kpack || !vpack || !tiles) {
        free(seqs), free(kpack), free(vpack), free(tiles);
        return -1;
    }
    int64_t t = 0;
    for (int s = 0; s < num_seqs; s++)
        for (int g = 0; g < num_kv_heads; g++)
            for (int64_t i0 = 0; i0 < seqs[s].q_len; i0 += BQ) {
                const int64_t i1 = i0 + BQ < seqs[s].q_len ? i0 + BQ : seqs[s].q_len;
                const int64_t end = seqs[s].seq_len - seqs[s].q_len + i1, /* keys seen */
                    start = window > 0 && end - (i1 - i0) + 1 > window
                                ? end - (i1 - i0) + 1 - window : 0;
                tiles[t++] = (Tile){s, g, i0, i1, end - start};
            }
    qsort(tiles, (size_t)num_tiles, sizeof(Tile), by_cost_desc);
    const int rows = BQ * (num_q_heads / num_kv_heads) + RB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch sc = {aligned_alloc(64, ((size_t)rows * head_dim * elem + 63) / 64 * 64),
                      malloc(sizeof(float) * (size_t)rows * head_dim),
                      malloc(sizeof(float) * (size_t)rows), malloc(sizeof(float) * (size_t)rows),
                      malloc(sizeof(int64_t) * (size_t)rows),
                      malloc(sizeof(int64_t) * (size_t)rows)};
        if (!sc.q || !sc.o || !sc.m || !sc.l || !sc.lim || !sc.first) {
#pragma omp atomic write
            failed = 1;
        }
        /* phase 1: pack every (sequence, kv head, key block) */
        for (int s = 0; s < num_seqs; s++) {
            const Seq *sq = &seqs[s];
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < sq->key_blocks * num_kv_heads; b++) {
                const int64_t at = sq->packed + b;
                pack_block(sq, (int)(b / sq->key_blocks), sq->kb0 + b % sq->key_blocks, k_cache,
                           v_cache, is_bf16, num_kv_heads, head_dim, block_size,
                           (char *)kpack + at * block_bytes, (char *)vpack + at * block_bytes);
            }
        }
#pragma omp barrier
        /* phase 2: the tiles, costliest first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < num_tiles; k++) {
            if (failed) continue;
            run_tile(&tiles[k], &seqs[tiles[k].seq], q, q_row_stride, kpack, vpack, is_bf16,
                     num_q_heads, num_kv_heads, head_dim, scale, out, out_is_bf16, &sc);
        }
        free(sc.q), free(sc.o), free(sc.m), free(sc.l), free(sc.lim), free(sc.first);
    }
    free(seqs), free(kpack), free(vpack), free(tiles);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_row_stride, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)table_stride, (void)q_starts, (void)q_lens, (void)seq_lens, (void)num_seqs;
    (void)num_q_heads, (void)num_kv_heads, (void)block_size, (void)scale, (void)window;
    (void)out;
    (void)out_is_bf16, (void)num_threads;
    return -2;
#endif
}
