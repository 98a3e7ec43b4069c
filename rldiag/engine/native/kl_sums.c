/* Per-row masked sums of the three KL estimators of J. Schulman, "Approximating KL divergence"
 * (2020), from d = a - b, in one read of the two log-prob streams and the mask: k1 = d,
 * k2 = d^2 (the caller halves it), and verl's low_var_kl ("k3", verl/trainer/ppo/core_algos.py,
 * kl_penalty_forward): x = clamp(-d, -20, 20), clamp(exp(x) - x - 1, -10, 10). Its torch twin
 * (rldiag/engine/kl.py, kl_row_sums) makes about a dozen passes over token-sized float32 tensors.
 *
 * d and x are float32, as torch's (a difference and a clamp: the same bits). From there on
 * float64: x^2 exact, exp(x) by lanes.h's vexp (within 2 units in the last place of float64),
 * exp(x) - x - 1 without the float32 rounding of exp that torch's k3 carries (about 6e-8 of
 * exp(x), which for a small x is most of k3), and every sum. So k1 and k2 differ from the twin's
 * by the rounding of its float32 products and sums; k3 by about 6e-8 per token, the twin's own
 * error (tests/engine/test_kl_native.py holds them to that).
 *
 * A token counts with its mask's weight where the mask is not 0 (a 0/1 mask: a count); a NaN or
 * an infinity off the mask goes nowhere (a select, not a product), as verl's masked_sum.
 *
 * Plain C loaded through ctypes (rldiag/engine/kl_native.py), built like mismatch_chunk.c: IEEE
 * float64 in the source's order, no contraction, the same bits on every run.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"

#define BLOCK 128

/* the output's fields per row, in this order */
enum { O_K1, O_K2, O_K3, N_OUT };

int rldiag_kl_abi(void) { return 1; }

int rldiag_kl_fields(void) { return N_OUT; }

/* verl's k3 of x = clamp(-d, -20, 20): clamp(exp(x) - x - 1, -10, 10), in float32, eight lanes.
 * x = k ln 2 + r (Cody and Waite's two-part ln 2), |r| <= ln 2 / 2, and exp(r) = 1 + r + r^2 q(r)
 * with q the Taylor series to r^5 / 7! (the next term under 1e-7 of r^2 q). Where k = 0 (|x| <=
 * ln 2 / 2) r is x itself and k3 is r^2 q: no cancellation of 1 + x against exp(x), so its
 * float32 rounding is a few 1e-7 of k3 (torch's exp(x) - x - 1 carries exp's rounding, about 6e-8
 * of 1, however small k3 is). Elsewhere 2^k (1 + r + r^2 q) - x - 1, at least 0.05 there: a few
 * 1e-7 of it. A NaN stays NaN. */
INLINE v8f k3_of(v8f x) {
    const float log2e = 1.44269504f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f, shifter = 12582912.0f;
    v8f t = x * splat8(log2e) + splat8(shifter); /* round to nearest: k in the low bits */
    v8i k = (v8i)t - (v8i)splat8(shifter);
    v8f kf = t - splat8(shifter);
    v8f r = (x - kf * splat8(ln2_hi)) - kf * splat8(ln2_lo);
    v8f q = splat8(1.0f / 5040) * r + splat8(1.0f / 720);
    q = q * r + splat8(1.0f / 120);
    q = q * r + splat8(1.0f / 24);
    q = q * r + splat8(1.0f / 6);
    q = q * r + splat8(0.5f);
    v8f inner = (r * r) * q; /* exp(r) - 1 - r */
    v8f scale = (v8f)((k + 127) << 23);
    v8f outer = ((splat8(1.0f) + (r + inner)) * scale - x) - splat8(1.0f);
    return clamp8(select8(k == 0, inner, outer), -10.0f, 10.0f);
}

/* the eight lanes' sum in float64, in a fixed order */
INLINE double lanes8(v8f v) {
    return (((double)v[0] + v[1]) + ((double)v[2] + v[3])) + (((double)v[4] + v[5]) + ((double)v[6] + v[7]));
}

/* the terms of eight tokens at a, b with mask values w, added to the block's sums */
INLINE void add8(v8f xa, v8f xb, v8f w, v8f *s1, v8f *s2, v8f *s3) {
    v8i on = w != splat8(0.0f);
    v8f d = xa - xb; /* float32, as torch's logprob - ref_logprob */
    v8f k3 = k3_of(clamp8(-d, -20.0f, 20.0f));
    *s1 += w * select8(on, d, splat8(0.0f));
    *s2 += w * select8(on, d * d, splat8(0.0f));
    *s3 += w * select8(on, k3, splat8(0.0f));
}

/* a, b: (tokens,) float32 log-probs (d = a - b); fmask: (tokens,) the float32 mask, else flags:
 * (tokens,) its 0/1 bytes, else every token counts; offsets: (n_rows + 1,) the rows' token
 * offsets. Out: (n_rows, N_OUT) float64: per row the masked sums of d, d^2 and k3 (float32
 * terms, summed in float32 over blocks of BLOCK tokens, the blocks in float64). Returns 0. */
__attribute__((target_clones("avx2", "default")))
long rldiag_kl_sums(const float *a, const float *b, const float *fmask, const uint8_t *flags, const int64_t *offsets,
                    long n_rows, double *out) {
    for (long r = 0; r < n_rows; r++) {
        double t1 = 0.0, t2 = 0.0, t3 = 0.0;
        long end = offsets[r + 1];
        for (long b0 = offsets[r]; b0 < end; b0 += BLOCK) {
            long stop = end - b0 < BLOCK ? end : b0 + BLOCK;
            v8f s1 = splat8(0.0f), s2 = splat8(0.0f), s3 = splat8(0.0f), xa, xb;
            long i = b0;
            for (; i + 8 <= stop; i += 8) {
                memcpy(&xa, a + i, sizeof xa);
                memcpy(&xb, b + i, sizeof xb);
                add8(xa, xb, mask8(fmask, flags, i), &s1, &s2, &s3);
            }
            if (i < stop) { /* the block's last tokens, padded off the mask */
                float fa[8] = {0}, fb[8] = {0}, fm[8] = {0};
                for (long j = 0; j < stop - i; j++) {
                    fa[j] = a[i + j];
                    fb[j] = b[i + j];
                    fm[j] = fmask != NULL ? fmask[i + j] : flags != NULL ? (float)flags[i + j] : 1.0f;
                }
                v8f w;
                memcpy(&xa, fa, sizeof xa);
                memcpy(&xb, fb, sizeof xb);
                memcpy(&w, fm, sizeof w);
                add8(xa, xb, w, &s1, &s2, &s3);
            }
            t1 += lanes8(s1);
            t2 += lanes8(s2);
            t3 += lanes8(s3);
        }
        double *o = out + r * N_OUT;
        o[O_K1] = t1;
        o[O_K2] = t2;
        o[O_K3] = t3;
    }
    return 0;
}
