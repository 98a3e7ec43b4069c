/* What the engine's compiled kernels share: four-lane float64 vectors (GCC's vector types: the
 * AVX2 instructions where the function is compiled for them, SSE2's two lanes twice otherwise,
 * the same operations in the same order, so the same bits) and their exponential. */
#ifndef RLDIAG_LANES_H
#define RLDIAG_LANES_H

#include <stdint.h>
#include <string.h>

typedef double v4d __attribute__((vector_size(32)));
typedef long long v4l __attribute__((vector_size(32)));
typedef int v4i __attribute__((vector_size(16)));
typedef float v4f __attribute__((vector_size(16)));
typedef unsigned char v4b __attribute__((vector_size(4)));

#define INLINE static inline __attribute__((always_inline))

/* the sum of a vector's lanes, in a fixed order */
INLINE double lanes(v4d v) { return (v[0] + v[1]) + (v[2] + v[3]); }
INLINE long long lanes_l(v4l v) { return (v[0] + v[1]) + (v[2] + v[3]); }
INLINE v4d and_(v4d v, v4l mask) { return (v4d)((v4l)v & mask); }
INLINE v4d load(const double *p) { v4d v; memcpy(&v, p, sizeof v); return v; }
INLINE v4l load_l(const long long *p) { v4l v; memcpy(&v, p, sizeof v); return v; }

/* exp(a) for -708 <= a <= 709, four lanes: a = k ln 2 + r (Cody and Waite's two-part ln 2, so
 * that k ln2_hi is exact), |r| <= ln 2 / 2, exp(r) by its Taylor series to r^13 / 13! (the next
 * term under 2^-58 of it, by Estrin's scheme), times 2^k built in the exponent's bits. Within 2
 * units in the last place of the exact value (tests/engine/test_mismatch_native.py holds it to
 * numpy's exp from 0 to 700). Outside its range the caller clamps or takes libm's. */
INLINE v4d vexp(v4d a) {
    const double inv_ln2 = 1.4426950408889634, ln2_hi = 6.93147180369123816490e-01,
                 ln2_lo = 1.90821492927058770002e-10, shifter = 6755399441055744.0; /* 2^52 + 2^51 */
    v4d t = a * inv_ln2 + shifter; /* round to nearest: k in the low bits */
    v4l k = (v4l)t - (v4l)(v4d){shifter, shifter, shifter, shifter};
    v4d kd = t - shifter;
    v4d r = (a - kd * ln2_hi) - kd * ln2_lo;
    /* 1 / i!, the terms paired, then pairs of pairs (Estrin's scheme: a chain of 4 products and
     * sums, not Horner's 13, so that the out-of-order core overlaps the tokens) */
    v4d r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
    v4d p01 = 1.0 + r, p23 = 1.0 / 2 + r * (1.0 / 6), p45 = 1.0 / 24 + r * (1.0 / 120),
        p67 = 1.0 / 720 + r * (1.0 / 5040), p89 = 1.0 / 40320 + r * (1.0 / 362880),
        p1011 = 1.0 / 3628800 + r * (1.0 / 39916800), p1213 = 1.0 / 479001600 + r * (1.0 / 6227020800.0);
    v4d q0 = p01 + r2 * p23, q1 = p45 + r2 * p67, q2 = p89 + r2 * p1011;
    v4d e = (q0 + r4 * q1) + r8 * (q2 + r4 * p1213);
    v4d scale = (v4d)((k + 1023) << 52);
    return e * scale;
}

/* eight-lane float32 vectors (AVX2's 256 bits where compiled for them, SSE2's twice otherwise) */
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

INLINE v8f splat8(float a) { return (v8f){a, a, a, a, a, a, a, a}; }
INLINE v8f select8(v8i on, v8f a, v8f b) { return (v8f)((on & (v8i)a) | (~on & (v8i)b)); }

/* a clamped to [lo, hi]; a NaN stays NaN (the comparisons are false for it), as torch.clamp */
INLINE v8f clamp8(v8f a, float lo, float hi) {
    a = select8(a < splat8(lo), splat8(lo), a);
    return select8(a > splat8(hi), splat8(hi), a);
}

/* exp(a) in float32, eight lanes, for every float32 a: a = k ln 2 + r (Cody and Waite's two-part
 * ln 2, a clamped to [-104, 89] first: 0 below, inf above, as float32's own range),
 * |r| <= ln 2 / 2, exp(r) = 1 + r + r^2 P(r) with the degree-5 minimax P of Moshier's Cephes
 * expf (within about 1 unit in the last place), times 2^k as two powers of 2 built in the
 * exponent's bits (each a normal float, so that a result below float32's normal range rounds
 * to its subnormal or 0 as torch's does). A NaN stays NaN. */
INLINE v8f vexp8f(v8f a) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f,
                shifter = 12582912.0f; /* 2^23 + 2^22 */
    v8f x = clamp8(a, -104.0f, 89.0f);
    v8f t = x * splat8(log2e) + splat8(shifter); /* round to nearest: k in the low bits */
    v8i k = (v8i)t - (v8i)splat8(shifter);
    v8f kf = t - splat8(shifter);
    v8f r = (x - kf * splat8(ln2_hi)) - kf * splat8(ln2_lo);
    v8f p = splat8(1.9875691500e-4f) * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    v8f e = splat8(1.0f) + (r + (r * r) * p);
    v8i k1 = k >> 1, k2 = k - k1; /* 2^k = 2^k1 2^k2, each within the normal range */
    return (e * (v8f)((k1 + 127) << 23)) * (v8f)((k2 + 127) << 23);
}

#endif
