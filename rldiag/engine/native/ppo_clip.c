/* verl's PPO clipped surrogate with dual clip per token (verl/trainer/ppo/core_algos.py,
 * compute_policy_loss_vanilla; arXiv:1707.06347 eq. 7, dual clip arXiv:1912.09729), from the
 * advantages A and the ratios r that torch computed (exp stays torch's), in one read where torch
 * makes about fourteen passes (rldiag/engine/policy_loss/clip.py, ppo_terms and the indicators,
 * its twin):
 *
 *   l1 = -A r,  l2 = -A clip(r, lo, hi),  clipped1 = max(l1, l2),  l3 = |A| c,
 *   loss = copysign(min(clipped1, l3), clipped1)  (times the IS weight where given),
 *
 * the clip indicator (l2 > l1 on the mask, 0/1) and, per row, the tokens where the dual clip
 * binds (clipped1 > l3 on the mask: actor/pg_clipfrac_lower's count). Every value is a float32
 * negation, product, comparison, clamp, maximum, minimum or sign copy in the twin's order, so
 * the same bits as torch's: max and min propagate a NaN as torch.maximum and torch.minimum do,
 * and the clamp keeps a NaN as torch.clamp does. (r > 0, so l1 and l2 carry -A's sign, zeros
 * included: no maximum of zeros of opposite signs.)
 *
 * Eight float32 lanes at a time (lanes.h), a row's last tokens padded off the mask. Plain C
 * loaded through ctypes (rldiag/engine/ppo_native.py), built like mismatch_chunk.c: IEEE
 * arithmetic in the source's order, no contraction.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"

int rldiag_ppo_abi(void) { return 1; }

int rldiag_ppo_fields(void) { return 1; }

/* max and min as torch.maximum and torch.minimum: a NaN in either gives a NaN; otherwise a > b
 * (a < b) picks a, else b */
INLINE v8f max_nan8(v8f a, v8f b) { return select8(a != a, a, select8(b != b, b, select8(a > b, a, b))); }

INLINE v8f min_nan8(v8f a, v8f b) { return select8(a != a, a, select8(b != b, b, select8(a < b, a, b))); }

/* eight tokens: their losses and clip indicators written, the dual clip's lanes counted (a true
 * lane adds -1 to `lower`) */
INLINE void tokens8(v8f a, v8f r, v8i on, const float *w, v8f lo, v8f hi, v8f c, float *loss_out, float *clip_out,
                    v8i *lower) {
    v8f neg = -a;
    v8f l1 = neg * r;
    v8f cr = select8(r < lo, lo, select8(r > hi, hi, r)); /* torch.clamp: a NaN stays */
    v8f l2 = neg * cr;
    v8f c1 = max_nan8(l1, l2);
    v8f l3 = (v8f)((v8i)a & 0x7FFFFFFF) * c; /* |A| (the sign bit cleared, as torch.abs) times c */
    v8f m = min_nan8(c1, l3);
    m = (v8f)(((v8i)m & 0x7FFFFFFF) | ((v8i)c1 & (int)0x80000000)); /* copysign(m, clipped1) */
    if (w != NULL) {
        v8f wt;
        memcpy(&wt, w, sizeof wt);
        m = m * wt;
    }
    memcpy(loss_out, &m, sizeof m);
    v8f one = select8(on & (l2 > l1), splat8(1.0f), splat8(0.0f));
    memcpy(clip_out, &one, sizeof one);
    *lower += on & (c1 > l3);
}

/* the mask's eight lanes at i as all-ones where the token is on it (> 0; a byte not 0) */
INLINE v8i on8(const float *fmask, const uint8_t *bmask, long i) {
    if (fmask != NULL) {
        v8f m;
        memcpy(&m, fmask + i, sizeof m);
        return m > splat8(0.0f);
    }
    typedef unsigned char v8b __attribute__((vector_size(8)));
    v8b b;
    memcpy(&b, bmask + i, sizeof b);
    return __builtin_convertvector(b, v8i) != 0;
}

/* adv, ratio: (tokens,) float32; fmask: the float32 mask, else bmask its bytes; weights: (tokens,)
 * float32 IS weights or NULL; offsets: (n_rows + 1,); lo, hi: the clip bounds 1 - clip_low and
 * 1 + clip_high and c the dual clip's, each as float32 (torch casts a Python number to the
 * tensor's dtype). Writes losses and clipped (tokens,) float32 and lower (n_rows,) float64
 * (exact counts). Returns 0. */
__attribute__((target_clones("avx2", "default")))
long rldiag_ppo_clip(const float *adv, const float *ratio, const float *fmask, const uint8_t *bmask,
                     const float *weights, const int64_t *offsets, long n_rows, float lo, float hi, float c,
                     float *losses, float *clipped, double *lower) {
    const v8f vlo = splat8(lo), vhi = splat8(hi), vc = splat8(c);
    for (long row = 0; row < n_rows; row++) {
        v8i count = {0, 0, 0, 0, 0, 0, 0, 0};
        long i = offsets[row], end = offsets[row + 1];
        for (; i + 8 <= end; i += 8) {
            v8f a, r;
            memcpy(&a, adv + i, sizeof a);
            memcpy(&r, ratio + i, sizeof r);
            tokens8(a, r, on8(fmask, bmask, i), weights != NULL ? weights + i : NULL, vlo, vhi, vc, losses + i,
                    clipped + i, &count);
        }
        if (i < end) { /* the row's last tokens, padded off the mask */
            float fa[8] = {0}, fr[8] = {0}, fw[8] = {0}, fl[8], fc[8];
            int32_t fo[8] = {0};
            for (long j = 0; j < end - i; j++) {
                fa[j] = adv[i + j];
                fr[j] = ratio[i + j];
                fw[j] = weights != NULL ? weights[i + j] : 0.0f;
                fo[j] = (fmask != NULL ? fmask[i + j] > 0.0f : bmask[i + j] != 0) ? -1 : 0;
            }
            v8f a, r;
            v8i on;
            memcpy(&a, fa, sizeof a);
            memcpy(&r, fr, sizeof r);
            memcpy(&on, fo, sizeof on);
            tokens8(a, r, on, weights != NULL ? fw : NULL, vlo, vhi, vc, fl, fc, &count);
            memcpy(losses + i, fl, (end - i) * sizeof(float));
            memcpy(clipped + i, fc, (end - i) * sizeof(float));
        }
        long long total = 0;
        for (int l = 0; l < 8; l++) {
            total -= count[l];
        }
        lower[row] = (double)total;
    }
    return 0;
}
