/* What the engine's compiled kernels share: four- and eight-lane float64 vectors (GCC's vector types: the
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
typedef unsigned long long v4u __attribute__((vector_size(32)));
typedef unsigned int v4iu __attribute__((vector_size(16)));
/* -1 in the lanes whose x is negative as a signed integer, else 0: a logical shift (AVX2 has no
 * 64-bit arithmetic one) and a negation, no comparison (GCC 12 makes scalar code of AVX-512
 * comparisons combined with other masks) */
INLINE v4l negative4(v4l x) { return -(v4l)((v4u)x >> 63); }
/* whether any lane of a mask is set */
INLINE int any4(v4l m) { return (m[0] | m[1]) | (m[2] | m[3]) ? 1 : 0; }

/* exp(a) for -708 <= a <= 709, in each lane of a float64 vector type VD whose integer twin is VL:
 * a = k ln 2 + r (Cody and Waite's two-part ln 2, so that k ln2_hi is exact), |r| <= ln 2 / 2,
 * exp(r) by its Taylor series to r^13 / 13! (the next term under 2^-58 of it, by Estrin's scheme),
 * times 2^k built in the exponent's bits. Within 2 units in the last place of the exact value
 * (tests/engine/test_mismatch_native.py holds it to numpy's exp from 0 to 700). Outside its
 * range the caller clamps or takes libm's. One body for four lanes (vexp) and eight (vexp8d). */
#define RLDIAG_VEXP_BODY(VD, VL, a)                                                                        \
    const double inv_ln2 = 1.4426950408889634, ln2_hi = 6.93147180369123816490e-01,                       \
                 ln2_lo = 1.90821492927058770002e-10, shifter = 6755399441055744.0; /* 2^52 + 2^51 */       \
    VD t = a * inv_ln2 + shifter; /* round to nearest: k in the low bits */                                 \
    VD shift = (VD){0} + shifter;                                                                          \
    VL k = (VL)t - (VL)shift;                                                                               \
    VD kd = t - shifter;                                                                                    \
    VD r = (a - kd * ln2_hi) - kd * ln2_lo;                                                                 \
    /* 1 / i!, the terms paired, then pairs of pairs (Estrin's scheme: a chain of 4 products and         \
     * sums, not Horner's 13, so that the out-of-order core overlaps the tokens) */                         \
    VD r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;                                                              \
    VD p01 = 1.0 + r, p23 = 1.0 / 2 + r * (1.0 / 6), p45 = 1.0 / 24 + r * (1.0 / 120),                      \
       p67 = 1.0 / 720 + r * (1.0 / 5040), p89 = 1.0 / 40320 + r * (1.0 / 362880),                          \
       p1011 = 1.0 / 3628800 + r * (1.0 / 39916800), p1213 = 1.0 / 479001600 + r * (1.0 / 6227020800.0);    \
    VD q0 = p01 + r2 * p23, q1 = p45 + r2 * p67, q2 = p89 + r2 * p1011;                                     \
    VD e = (q0 + r4 * q1) + r8 * (q2 + r4 * p1213);                                                         \
    VD scale = (VD)((k + 1023) << 52);                                                                      \
    return e * scale;

INLINE v4d vexp(v4d a) { RLDIAG_VEXP_BODY(v4d, v4l, a) }

/* eight-lane float64 vectors: AVX-512's 512 bits where compiled for them (twice the four lanes'
 * throughput on processors with full-width units), AVX2's or SSE2's twice or four times
 * otherwise: the same operations in the same order, so the same bits */
typedef double v8d __attribute__((vector_size(64)));
typedef long long v8l __attribute__((vector_size(64)));
typedef unsigned long long v8u __attribute__((vector_size(64)));
typedef unsigned char v8b __attribute__((vector_size(8)));

/* the sum of a vector's lanes, in a fixed order */
INLINE double lanes8d(v8d v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
INLINE long long lanes8l(v8l v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
INLINE v8d load8d(const double *p) { v8d v; memcpy(&v, p, sizeof v); return v; }
INLINE v8l load8l(const long long *p) { v8l v; memcpy(&v, p, sizeof v); return v; }
INLINE v8d splat8d(double a) { return __builtin_shuffle((v8d){a}, (v8l){0}); } /* as splat8 */
INLINE v8l negative8(v8l x) { return -(v8l)((v8u)x >> 63); }
INLINE int any8(v8l m) { return ((m[0] | m[1]) | (m[2] | m[3])) | ((m[4] | m[5]) | (m[6] | m[7])) ? 1 : 0; }

INLINE v8d vexp8d(v8d a) { RLDIAG_VEXP_BODY(v8d, v8l, a) }

/* exp(a) for 0 <= a <= 1/8 (SMALL_EXP): its Taylor series to a^10 / 10! (the next term under
 * 2^-58 of it; no range reduction), by Estrin's scheme. Within 2 units in the last place as
 * vexp, at about half its operations: most of a run's trainer-rollout gaps are this small. */
#define SMALL_EXP 0.125
#define RLDIAG_VEXP_SMALL_BODY(VD, a)                                                                     \
    VD a2 = a * a, a4 = a2 * a2, a8 = a4 * a4;                                                             \
    VD p01 = 1.0 + a, p23 = 1.0 / 2 + a * (1.0 / 6), p45 = 1.0 / 24 + a * (1.0 / 120),                     \
       p67 = 1.0 / 720 + a * (1.0 / 5040), p89 = 1.0 / 40320 + a * (1.0 / 362880);                        \
    VD q0 = p01 + a2 * p23, q1 = p45 + a2 * p67, q2 = p89 + a2 * (1.0 / 3628800);                          \
    return (q0 + a4 * q1) + a8 * q2;

INLINE v4d vexp4d_small(v4d a) { RLDIAG_VEXP_SMALL_BODY(v4d, a) }
INLINE v8d vexp8d_small(v8d a) { RLDIAG_VEXP_SMALL_BODY(v8d, a) }

/* eight-lane float32 vectors (AVX2's 256 bits where compiled for them, SSE2's twice otherwise) */
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));
typedef unsigned int v8iu __attribute__((vector_size(32)));

/* a in every lane: one broadcast (GCC 12 builds {a, a, ...} of a value known only at run time
 * element by element, inside the loop, in its AVX2 clones: nine instructions a use) */
INLINE v8f splat8(float a) { return __builtin_shuffle((v8f){a}, (v8i){0}); }
INLINE v8f select8(v8i on, v8f a, v8f b) { return (v8f)((on & (v8i)a) | (~on & (v8i)b)); }

/* eight values of a mask at token i as float32: the float32 array f's, else the byte array b's
 * (each byte moved to its lane by shifts: GCC makes scalar code of a conversion from bytes), else
 * 1 (no mask) */
INLINE v8f mask8(const float *f, const uint8_t *b, long i) {
    v8f m;
    if (f != NULL) {
        memcpy(&m, f + i, sizeof m);
    } else if (b != NULL) {
        uint64_t w;
        memcpy(&w, b + i, sizeof w);
        unsigned lo = (unsigned)w, hi = (unsigned)(w >> 32);
        v8iu v = (v8iu){lo, lo, lo, lo, hi, hi, hi, hi} >> (v8iu){0, 8, 16, 24, 0, 8, 16, 24};
        m = __builtin_convertvector((v8i)(v & 0xFF), v8f);
    } else {
        m = splat8(1.0f);
    }
    return m;
}

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
