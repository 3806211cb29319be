/* Decode attention over block-quantized pages (kernels/block_quant.py: kivi4, k8v4, kivi2)
 * for the CPU, reading the codes where they lie: no dequantized copy of a page is made.
 *
 * Layout (block_quant's): K/V codes [num_blocks, block_size, Hkv, D * bits / 8] uint8
 * (element i of a byte's group in bits [bits * i, bits * (i + 1))); K scales uint8
 * [num_blocks, Hkv, D, 2] per channel (8-bit pair codes; 6-bit ones: [num_blocks, Hkv, D/2,
 * 3], two channels' pairs in 24 bits, read with k_table and a zero offset of 32) or
 * [num_blocks, block_size, Hkv, 2] per token; V
 * scales [num_blocks, block_size, Hkv, 2]; supers [num_blocks, Hkv, 2] fp16 (smax, zstep).
 * A scale pair (c, z) means scale = smax * table[c], zero = (z - 128) * zstep, table the
 * caller's 256 float32 factors (block_quant.scale_table(), so both sides use the same
 * numbers). A block whose slot_of entry is >= 0 is still in the residual window: its tokens
 * are read at full precision from residual rows [R, block_size, Hkv, D] float32.
 *
 * Why no dequantization: per-channel keys give <q, k_t> = sum_d q_d zero_d +
 * sum_d (q_d scale_d) code_td, so each (block, head) folds its scales into the query once
 * and every token costs one dot product with its codes; per-token values give
 * sum_t p_t v_t = sum_t (p_t scale_t) code_t + (sum_t p_t zero_t), so the zero is one
 * scalar per head.
 *
 * The pages hold K and V in the Hadamard basis (kernels.quant.hadamard) when the format
 * rotates them: with rotate_k the kernel rotates each query head (a fast Walsh-Hadamard
 * transform, D log D adds, in the order of Sylvester's matrix, which is symmetric) before
 * scoring, with rotate_v it rotates each output row back; so the caller passes q and gets
 * out in the model's basis. With new_k/new_v it also writes the step's token of each
 * sequence (rotated likewise) into residual row new_rows[s], offset new_offsets[s], before
 * that sequence is read: one task per (sequence, kv head) writes exactly the head it reads,
 * and a block being written belongs to one sequence (copy-on-write), so no other task
 * reads it. Why here and not in torch: those are a handful of tiny ops per layer whose
 * dispatch cost rivals the attention itself at decode (docs/benchmarks/quant.md).
 *
 * One task per (sequence, kv head), over OpenMP threads; two passes: scores for every key
 * of the sequence, then softmax weights times V. The caller validated lengths and block ids
 * (kernels.cpu_attention.StepPlan): this file trusts them. Built by kernels/cpu_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float half_to_f32(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}

/* x [n] (n a power of two) -> x H, H the orthonormal Sylvester-Hadamard matrix, in place */
static void fwht(float *x, int n) {
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                const float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
    const float norm = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++) x[i] *= norm;
}

/* packed codes of one row -> float32 code values */
static inline void unpack_row(const uint8_t *src, int bits, int head_dim, float *dst) {
    if (bits == 8) {
        for (int d = 0; d < head_dim; d++) dst[d] = (float)src[d];
    } else if (bits == 4) {
        for (int j = 0; j < head_dim / 2; j++) {
            dst[2 * j] = (float)(src[j] & 15);
            dst[2 * j + 1] = (float)(src[j] >> 4);
        }
    } else { /* 2 */
        for (int j = 0; j < head_dim / 4; j++) {
            const uint8_t b = src[j];
            dst[4 * j] = (float)(b & 3);
            dst[4 * j + 1] = (float)((b >> 2) & 3);
            dst[4 * j + 2] = (float)((b >> 4) & 3);
            dst[4 * j + 3] = (float)(b >> 6);
        }
    }
}

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

typedef struct {
    const uint8_t *k_codes, *k_scales, *v_codes, *v_scales;
    const uint16_t *k_supers, *v_supers;
    float *residual_k, *residual_v; /* written only by write_new */
    const float *table, *k_table;
    const int64_t *slot_of;
    int key_bits, value_bits, keys_per_channel, key_pair_bits;
    int num_q_heads, num_kv_heads, head_dim, block_size;
} Pages;

/* One sequence's query heads of kv head kvh over its keys [0, len): out rows of those heads.
 * Scratch: scores [group * len], work [(3 * group + 1) * head_dim + 2 * group]. */
static void attend_head(const Pages *p, const float *q, const int64_t *blocks, int64_t len,
                        int kvh, float scale, int rotate_k, int rotate_v, float *out,
                        float *scores, float *work) {
    const int D = p->head_dim, Hkv = p->num_kv_heads, bs = p->block_size;
    const int group = p->num_q_heads / Hkv;
    const int kd = D * p->key_bits / 8, vd = D * p->value_bits / 8;
    float *codes = work, *qs = work + D, *qz = qs + (int64_t)group * D, *acc = qz + group;
    float *zsum = acc + (int64_t)group * D, *qrot = zsum + group;
    const float *qh = q + (int64_t)kvh * group * D; /* this kv head's query heads, in a row */
    if (rotate_k) { /* into the pages' basis */
        memcpy(qrot, qh, sizeof(float) * (size_t)group * D);
        for (int g = 0; g < group; g++) fwht(qrot + g * D, D);
        qh = qrot;
    }
    const int64_t num_blocks = (len + bs - 1) / bs;
    /* pass 1: scores */
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t blk = blocks[b], t0 = b * bs;
        const int n = (int)(len - t0 < bs ? len - t0 : bs);
        const int64_t row = p->slot_of[blk];
        if (row >= 0) { /* the residual window: full precision */
            for (int t = 0; t < n; t++) {
                const float *k = p->residual_k + ((row * bs + t) * Hkv + kvh) * D;
                for (int g = 0; g < group; g++)
                    scores[g * len + t0 + t] = scale * dot(qh + g * D, k, D);
            }
            continue;
        }
        const float smax = half_to_f32(p->k_supers[(blk * Hkv + kvh) * 2]);
        const float zstep = half_to_f32(p->k_supers[(blk * Hkv + kvh) * 2 + 1]);
        if (p->keys_per_channel) { /* fold the block's channel scales into the query */
            /* the channels' (scale, zero) first, into codes and acc (both >= D floats;
             * codes is rewritten per token below, acc is zeroed before pass 2) */
            float *cs = codes, *cz = acc;
            if (p->key_pair_bits == 6) { /* 2 channels' 6-bit pairs per 3 bytes */
                const uint8_t *sc = p->k_scales + (blk * Hkv + kvh) * (D / 2) * 3;
                for (int d = 0; d < D; d += 2) {
                    const uint8_t *b3 = sc + (d / 2) * 3;
                    const uint32_t v = b3[0] | (uint32_t)b3[1] << 8 | (uint32_t)b3[2] << 16;
                    cs[d] = smax * p->k_table[v & 63];
                    cz[d] = ((float)((v >> 6) & 63) - 32.0f) * zstep;
                    cs[d + 1] = smax * p->k_table[(v >> 12) & 63];
                    cz[d + 1] = ((float)(v >> 18) - 32.0f) * zstep;
                }
            } else {
                const uint8_t *sc = p->k_scales + (blk * Hkv + kvh) * D * 2;
                for (int d = 0; d < D; d++) {
                    cs[d] = smax * p->k_table[sc[2 * d]];
                    cz[d] = ((float)sc[2 * d + 1] - 128.0f) * zstep;
                }
            }
            for (int g = 0; g < group; g++) {
                float z = 0.0f;
                for (int d = 0; d < D; d++) {
                    qs[g * D + d] = qh[g * D + d] * cs[d];
                    z += qh[g * D + d] * cz[d];
                }
                qz[g] = z;
            }
            for (int t = 0; t < n; t++) {
                unpack_row(p->k_codes + ((blk * bs + t) * Hkv + kvh) * kd, p->key_bits, D,
                           codes);
                for (int g = 0; g < group; g++)
                    scores[g * len + t0 + t] = scale * (qz[g] + dot(qs + g * D, codes, D));
            }
        } else { /* per token: <q, zero + s c> = zero sum(q) + s <q, c> */
            for (int g = 0; g < group; g++) {
                float z = 0.0f;
                for (int d = 0; d < D; d++) z += qh[g * D + d];
                qz[g] = z;
            }
            for (int t = 0; t < n; t++) {
                const uint8_t *sc = p->k_scales + ((blk * bs + t) * Hkv + kvh) * 2;
                const float s = smax * p->table[sc[0]];
                const float zero = ((float)sc[1] - 128.0f) * zstep;
                unpack_row(p->k_codes + ((blk * bs + t) * Hkv + kvh) * kd, p->key_bits, D,
                           codes);
                for (int g = 0; g < group; g++)
                    scores[g * len + t0 + t] =
                        scale * (zero * qz[g] + s * dot(qh + g * D, codes, D));
            }
        }
    }
    /* softmax per query head (unnormalized; divided at the end) */
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * len, m = -INFINITY, l = 0.0f;
        for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        for (int64_t t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - m);
            l += sg[t];
        }
        qz[g] = l; /* reused: the softmax sums */
        zsum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)group * D);
    /* pass 2: weights times V */
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t blk = blocks[b], t0 = b * bs;
        const int n = (int)(len - t0 < bs ? len - t0 : bs);
        const int64_t row = p->slot_of[blk];
        if (row >= 0) {
            for (int t = 0; t < n; t++) {
                const float *v = p->residual_v + ((row * bs + t) * Hkv + kvh) * D;
                for (int g = 0; g < group; g++) {
                    const float w = scores[g * len + t0 + t];
                    float *a = acc + g * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) a[d] += w * v[d];
                }
            }
            continue;
        }
        const float smax = half_to_f32(p->v_supers[(blk * Hkv + kvh) * 2]);
        const float zstep = half_to_f32(p->v_supers[(blk * Hkv + kvh) * 2 + 1]);
        for (int t = 0; t < n; t++) {
            const uint8_t *sc = p->v_scales + ((blk * bs + t) * Hkv + kvh) * 2;
            const float s = smax * p->table[sc[0]];
            const float zero = ((float)sc[1] - 128.0f) * zstep;
            unpack_row(p->v_codes + ((blk * bs + t) * Hkv + kvh) * vd, p->value_bits, D, codes);
            for (int g = 0; g < group; g++) {
                const float w = scores[g * len + t0 + t];
                const float ws = w * s;
                float *a = acc + g * D;
                zsum[g] += w * zero;
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += ws * codes[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = 1.0f / qz[g];
        float *o = out + (int64_t)(kvh * group + g) * D;
        for (int d = 0; d < D; d++) o[d] = (acc[g * D + d] + zsum[g]) * inv;
        if (rotate_v) fwht(o, D); /* back to the model's basis (H is symmetric) */
    }
}

/* Write sequence s's new token of kv head kvh into its residual row (rotated as asked). */
static void write_new(const Pages *p, const float *new_k, const float *new_v,
                      const int64_t *new_rows, const int64_t *new_offsets, int s, int kvh,
                      int rotate_k, int rotate_v) {
    const int D = p->head_dim, Hkv = p->num_kv_heads, bs = p->block_size;
    const int64_t at = ((new_rows[s] * bs + new_offsets[s]) * Hkv + kvh) * D;
    const int64_t from = ((int64_t)s * Hkv + kvh) * D;
    float *k = p->residual_k + at, *v = p->residual_v + at;
    memcpy(k, new_k + from, sizeof(float) * (size_t)D);
    memcpy(v, new_v + from, sizeof(float) * (size_t)D);
    if (rotate_k) fwht(k, D);
    if (rotate_v) fwht(v, D);
}

/* q [num_seqs, Hq, D] float32 contiguous -> out [num_seqs, Hq, D] float32; new_k/new_v
 * [num_seqs, Hkv, D] float32 contiguous or NULL (nothing written). Returns -1 when a
 * scratch buffer could not be allocated, else 0. */
int kvscope_block_decode(const float *q, const uint8_t *k_codes, const uint8_t *k_scales,
                         const uint16_t *k_supers, const uint8_t *v_codes,
                         const uint8_t *v_scales, const uint16_t *v_supers,
                         float *residual_k, float *residual_v,
                         const int64_t *slot_of, const float *table, const float *k_table,
                         int key_bits, int value_bits, int keys_per_channel,
                         int key_pair_bits, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *seq_lens, int num_seqs,
                         int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale, int rotate_k, int rotate_v, const float *new_k,
                         const float *new_v, const int64_t *new_rows,
                         const int64_t *new_offsets, float *out, int num_threads) {
    const Pages p = {k_codes, k_scales, v_codes, v_scales, k_supers, v_supers, residual_k,
                     residual_v, table, k_table, slot_of, key_bits, value_bits,
                     keys_per_channel, key_pair_bits, num_q_heads, num_kv_heads, head_dim,
                     block_size};
    const int group = num_q_heads / num_kv_heads;
    const int64_t num_tasks = (int64_t)num_seqs * num_kv_heads;
    if (num_tasks <= 0) return 0;
    int64_t max_len = 1;
    for (int s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int threads = num_tasks < num_threads ? (int)num_tasks : num_threads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * max_len));
        float *work = malloc(sizeof(float) * (size_t)((3 * group + 1) * head_dim + 2 * group));
        if (!scores || !work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < num_tasks; k++) {
            if (failed) continue;
            const int s = (int)(k / num_kv_heads), kvh = (int)(k % num_kv_heads);
            const int64_t off = (int64_t)s * num_q_heads * head_dim;
            if (new_k)
                write_new(&p, new_k, new_v, new_rows, new_offsets, s, kvh, rotate_k, rotate_v);
            attend_head(&p, q + off, block_tables + s * table_stride, seq_lens[s], kvh, scale,
                        rotate_k, rotate_v, out + off, scores, work);
        }
        free(scores);
        free(work);
    }
    return failed ? -1 : 0;
}
