/* bfloat16 <-> float32 for the native CPU kernels (included by the C files in kernels/; the
 * build cache key in kernels/cpu_native.py hashes every header there, so a change here
 * rebuilds them).
 * bfloat16 is the top half of a float32. */
#ifndef KVSCOPE_CPU_BF16_H
#define KVSCOPE_CPU_BF16_H

#include <stdint.h>

/* Widen by a shift (vectorizes under omp simd). */
static inline float bf16_to_f32(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } c = {(uint32_t)x << 16};
    return c.f;
}

/* Round to nearest even, NaN -> quiet NaN: c10::BFloat16's rounding, i.e. what torch's
 * .to(torch.bfloat16) and every bfloat16 torch op store. */
static inline uint16_t f32_to_bf16(float x) {
    union {
        float f;
        uint32_t u;
    } c = {x};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#endif
