/* Fused per-token elementwise ops of the Llama forward for the CPU: RMSNorm, the residual
 * add + RMSNorm, RoPE in place on the q and k heads of the fused qkv output.
 * At one token each is a few hundred values: torch spends most of its time dispatching the
 * 5-8 small ops each of these is made of (kernels/cpu_fused.py).
 *
 * Numerics follow the torch code they replace (engine/model/llama.py, engine/model/rope.py)
 * op by op, rounding where torch rounds:
 *   * bfloat16 values are widened to float32, every torch op computes in float32 and rounds
 *     its result to bfloat16 (round to nearest even, as c10::BFloat16);
 *   * RMSNorm: sum of squares and mean in float32, x * (1 / sqrt(mean + eps)) rounded to the
 *     input dtype, THEN times the weight (transformers' order). Only the order of the sum
 *     of squares differs from torch's reduction;
 *   * RoPE: x * cos + rotate_half(x) * sin, each product rounded, then the sum: bit-exact.
 * SiLU(gate) * up is not here: with scalar expf (no vector math library without
 * -ffast-math) it measured 2-10x slower than torch's Sleef-vectorized F.silu.
 * Built with -std=c11 (no floating-point contraction: a * b + c is not fused into an FMA,
 * as torch's separate ops are not).
 *
 * Rows are split over OpenMP threads only when there are enough of them to pay for waking
 * the pool (a prefill); one decode token runs on the calling thread.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

/* Work (rows * values) below which a call stays on the calling thread. */
#define PARALLEL_MIN_WORK 32768

/* float32 rounded through bfloat16 (what a torch bfloat16 op stores). */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline int use_threads(int64_t rows, int64_t width, int num_threads) {
    return num_threads > 1 && rows > 1 && rows * width >= PARALLEL_MIN_WORK;
}

/* ---- RMSNorm ------------------------------------------------------------------------- */

static inline float inv_rms(float sum_sq, int n, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)n + eps);
}

static void rms_norm_row_f32(const float *x, const float *w, float *out, int n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = inv_rms(ss, n, eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

static void rms_norm_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int n,
                              float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++) {
        const float v = bf16_to_f32(x[i]);
        ss += v * v;
    }
    const float r = inv_rms(ss, n, eps);
#pragma omp simd
    for (int i = 0; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
}

static void rms_norm_row(const void *x, const void *w, void *out, int64_t row, int n,
                         float eps, int is_bf16) {
    if (is_bf16)
        rms_norm_row_bf16((const uint16_t *)x + row * n, w, (uint16_t *)out + row * n, n, eps);
    else
        rms_norm_row_f32((const float *)x + row * n, w, (float *)out + row * n, n, eps);
}

/* out[r] = rms_norm(x[r]) * weight; x, out [rows, n] contiguous, weight [n]. */
void kvscope_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int n,
                      float eps, int is_bf16, int num_threads) {
    if (!use_threads(rows, n, num_threads)) {
        for (int64_t r = 0; r < rows; r++) rms_norm_row(x, weight, out, r, n, eps, is_bf16);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x, weight, out, r, n, eps, is_bf16);
}

/* hidden[r] += delta[r] (rounded to the dtype), then out[r] = rms_norm(hidden[r]) * weight.
 * hidden, delta, out [rows, n] contiguous, weight [n]. */
static void add_row(void *hidden, const void *delta, int64_t row, int n, int is_bf16) {
    if (is_bf16) {
        uint16_t *h = (uint16_t *)hidden + row * n;
        const uint16_t *d = (const uint16_t *)delta + row * n;
#pragma omp simd
        for (int i = 0; i < n; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(d[i]));
    } else {
        float *h = (float *)hidden + row * n;
        const float *d = (const float *)delta + row * n;
#pragma omp simd
        for (int i = 0; i < n; i++) h[i] = h[i] + d[i];
    }
}

void kvscope_add_rms_norm(void *hidden, const void *delta, const void *weight, void *out,
                          int64_t rows, int n, float eps, int is_bf16, int num_threads) {
    if (!use_threads(rows, n, num_threads)) {
        for (int64_t r = 0; r < rows; r++) {
            add_row(hidden, delta, r, n, is_bf16);
            rms_norm_row(hidden, weight, out, r, n, eps, is_bf16);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        add_row(hidden, delta, r, n, is_bf16);
        rms_norm_row(hidden, weight, out, r, n, eps, is_bf16);
    }
}

/* ---- RoPE ---------------------------------------------------------------------------- */

/* One head of head_dim values, rotated in place (HF rotate_half layout): with h = head_dim/2,
 * out[i] = x[i] * cos[i] - x[i+h] * sin[i], out[i+h] = x[i+h] * cos[i+h] + x[i] * sin[i+h]. */
static void rope_head_f32(float *x, const float *c, const float *s, int half) {
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] + (-x2) * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

static void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int half) {
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
        const float a1 = round_bf16(x1 * bf16_to_f32(c[i]));
        const float b1 = round_bf16(-x2 * bf16_to_f32(s[i]));
        const float a2 = round_bf16(x2 * bf16_to_f32(c[i + half]));
        const float b2 = round_bf16(x1 * bf16_to_f32(s[i + half]));
        x[i] = f32_to_bf16(a1 + b1);
        x[i + half] = f32_to_bf16(a2 + b2);
    }
}

static void rope_token(void *x, int64_t row_stride, const void *cos, const void *sin,
                       int64_t t, int heads, int head_dim, int is_bf16) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        const int64_t at = t * row_stride + (int64_t)h * head_dim;
        if (is_bf16)
            rope_head_bf16((uint16_t *)x + at, (const uint16_t *)cos + t * head_dim,
                           (const uint16_t *)sin + t * head_dim, half);
        else
            rope_head_f32((float *)x + at, (const float *)cos + t * head_dim,
                          (const float *)sin + t * head_dim, half);
    }
}

/* x: token t's heads start at x + t * row_stride, heads * head_dim contiguous values (the q
 * and k columns of a qkv row); cos, sin [tokens, head_dim] contiguous. In place. */
void kvscope_rope(void *x, int64_t row_stride, const void *cos, const void *sin,
                  int64_t tokens, int heads, int head_dim, int is_bf16, int num_threads) {
    if (!use_threads(tokens, (int64_t)heads * head_dim, num_threads)) {
        for (int64_t t = 0; t < tokens; t++)
            rope_token(x, row_stride, cos, sin, t, heads, head_dim, is_bf16);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; t++)
        rope_token(x, row_stride, cos, sin, t, heads, head_dim, is_bf16);
}
