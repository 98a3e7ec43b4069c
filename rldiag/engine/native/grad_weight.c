/* The gradient weight of a step's tokens in one read, for rldiag's health signals
 * (rldiag/engine/health.py, gradient_weight_shares, its torch twin: about fifteen passes over
 * token-sized tensors a piece): each token's g = |A| w in float32, its unclipped part
 * g (1 - c), and per step the actor tokens, the unclipped weight they carry, and the weight the
 * clip zeroes and its whole (the clipped share's numerator and denominator), with the ranking the
 * top share selects from: the unclipped weight on actor tokens, -1 elsewhere.
 *
 * Every float32 value is torch's to the bit (one product, one difference); the sums are float64,
 * in lanes in a fixed order (torch's: pairwise), so they differ from the twin's by float64's
 * rounding. An actor token is one whose mask is above 0; a NaN or an infinity off the actor
 * tokens goes nowhere in the top share (a select), and counts in the clipped share's sums over
 * every token as it does in the twin.
 *
 * Plain C loaded through ctypes (rldiag/engine/grad_weight_native.py), built like
 * mismatch_chunk.c: IEEE arithmetic in the source's order, no contraction, the same bits on
 * every run.
 */
#include <stdint.h>
#include <string.h>

#include "lanes.h"

/* the output's fields, in this order */
enum { O_COUNT, O_TOTAL, O_NUM, O_DEN, N_OUT };

int rldiag_gw_abi(void) { return 1; }

int rldiag_gw_fields(void) { return N_OUT; }

/* the eight float32 lanes of v widened and added to the two float64 accumulators */
INLINE void widen_add(v4d *lo, v4d *hi, v8f v) {
    v4f a = {v[0], v[1], v[2], v[3]}, b = {v[4], v[5], v[6], v[7]};
    *lo += __builtin_convertvector(a, v4d);
    *hi += __builtin_convertvector(b, v4d);
}

INLINE v4d widen_lo(v8f v) { return __builtin_convertvector(((v4f){v[0], v[1], v[2], v[3]}), v4d); }
INLINE v4d widen_hi(v8f v) { return __builtin_convertvector(((v4f){v[4], v[5], v[6], v[7]}), v4d); }

typedef struct {
    v4d total_lo, total_hi, num_lo, num_hi, den_lo, den_hi;
    v8i count;
} Sums;

INLINE void tokens8(v8f a, v8f w, v8f m, v8f c, int clip, float *ranked, Sums *s) {
    v8f g = (v8f)((v8i)a & 0x7FFFFFFF) * w; /* |A| w (the sign bit cleared, as torch's abs), then the product */
    v8i on = m > splat8(0.0f);
    if (clip) {
        v8f con = c * select8(on, splat8(1.0f), splat8(0.0f)); /* c x on in float32, as the twin's */
        widen_add(&s->den_lo, &s->den_hi, g);
        s->num_lo += widen_lo(g) * widen_lo(con);
        s->num_hi += widen_hi(g) * widen_hi(con);
        g = g * (splat8(1.0f) - c);
    }
    v8f kept = select8(on, g, splat8(0.0f));
    widen_add(&s->total_lo, &s->total_hi, kept);
    v8f rank = select8(on, g, splat8(-1.0f));
    memcpy(ranked, &rank, sizeof rank);
    s->count -= on; /* a true lane is -1 */
}

/* One step's n tokens: adv, w (n,) float32; the mask as float32 (fmask) or 0/1 bytes (bmask);
 * the clip indicator as float32 (fclip) or bytes (bclip), or neither (nothing clipped: num and
 * den 0). Writes ranked (n,) float32 and out (N_OUT,) float64: the actor tokens, the unclipped
 * weight on them, the clipped weight on them and the weight of every token. Returns 0. */
__attribute__((target_clones("avx2", "default")))
long rldiag_grad_weight(const float *adv, const float *w, const float *fmask, const uint8_t *bmask, const float *fclip,
                        const uint8_t *bclip, long n, float *ranked, double *out) {
    const v4d zero = {0.0, 0.0, 0.0, 0.0};
    Sums s = {zero, zero, zero, zero, zero, zero, {0, 0, 0, 0, 0, 0, 0, 0}};
    int clip = fclip != NULL || bclip != NULL;
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f a, ww;
        memcpy(&a, adv + i, sizeof a);
        memcpy(&ww, w + i, sizeof ww);
        v8f c = clip ? mask8(fclip, bclip, i) : splat8(0.0f);
        tokens8(a, ww, mask8(fmask, bmask, i), c, clip, ranked + i, &s);
    }
    if (i < n) { /* the last tokens, padded off the mask (and weight 0) */
        float fa[8] = {0}, fw[8] = {0}, fm[8] = {0}, fc[8] = {0}, fr[8];
        for (long j = 0; j < n - i; j++) {
            fa[j] = adv[i + j];
            fw[j] = w[i + j];
            fm[j] = fmask != NULL ? fmask[i + j] : (float)bmask[i + j];
            fc[j] = fclip != NULL ? fclip[i + j] : bclip != NULL ? (float)bclip[i + j] : 0.0f;
        }
        v8f a, ww, m, c;
        memcpy(&a, fa, sizeof a);
        memcpy(&ww, fw, sizeof ww);
        memcpy(&m, fm, sizeof m);
        memcpy(&c, fc, sizeof c);
        tokens8(a, ww, m, c, clip, fr, &s);
        memcpy(ranked + i, fr, (n - i) * sizeof(float));
    }
    long long count = 0; /* a lane counts at most n / 8 tokens: no int32 lane wraps below 2^34 tokens */
    for (int l = 0; l < 8; l++) {
        count += s.count[l];
    }
    out[O_COUNT] = (double)count;
    out[O_TOTAL] = lanes(s.total_lo) + lanes(s.total_hi);
    out[O_NUM] = lanes(s.num_lo) + lanes(s.num_hi);
    out[O_DEN] = lanes(s.den_lo) + lanes(s.den_hi);
    return 0;
}
