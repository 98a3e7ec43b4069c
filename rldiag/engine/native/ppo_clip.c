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
 * Plain C loaded through ctypes (rldiag/engine/ppo_native.py), built like mismatch_chunk.c: IEEE
 * arithmetic in the source's order, no contraction.
 */
#include <stddef.h>
#include <stdint.h>

int rldiag_ppo_abi(void) { return 1; }

int rldiag_ppo_fields(void) { return 1; }

static inline float max_nan(float a, float b) { return a != a ? a : b != b ? b : (a > b ? a : b); }

static inline float min_nan(float a, float b) { return a != a ? a : b != b ? b : (a < b ? a : b); }

/* adv, ratio: (tokens,) float32; fmask: the float32 mask, else bmask its bytes; weights: (tokens,)
 * float32 IS weights or NULL; offsets: (n_rows + 1,); lo, hi: the clip bounds 1 - clip_low and
 * 1 + clip_high and c the dual clip's, each as float32 (torch casts a Python number to the
 * tensor's dtype). Writes losses and clipped (tokens,) float32 and lower (n_rows,) float64
 * (exact counts). Returns 0. */
__attribute__((target_clones("avx2", "default")))
long rldiag_ppo_clip(const float *adv, const float *ratio, const float *fmask, const uint8_t *bmask,
                     const float *weights, const int64_t *offsets, long n_rows, float lo, float hi, float c,
                     float *losses, float *clipped, double *lower) {
    for (long row = 0; row < n_rows; row++) {
        long count = 0;
        for (long i = offsets[row]; i < offsets[row + 1]; i++) {
            float a = adv[i], r = ratio[i];
            float neg = -a;
            float l1 = neg * r;
            float cr = r < lo ? lo : (r > hi ? hi : r);
            float l2 = neg * cr;
            float c1 = max_nan(l1, l2);
            uint32_t ab;
            __builtin_memcpy(&ab, &a, 4);
            ab &= 0x7FFFFFFFu; /* |A|: the sign bit cleared, as torch.abs */
            float abs_a;
            __builtin_memcpy(&abs_a, &ab, 4);
            float l3 = abs_a * c;
            float m = min_nan(c1, l3);
            uint32_t mb, cb;
            __builtin_memcpy(&mb, &m, 4);
            __builtin_memcpy(&cb, &c1, 4);
            mb = (mb & 0x7FFFFFFFu) | (cb & 0x80000000u); /* copysign(m, clipped1) */
            __builtin_memcpy(&m, &mb, 4);
            if (weights != NULL) {
                m = m * weights[i];
            }
            losses[i] = m;
            int on = fmask != NULL ? fmask[i] > 0.0f : bmask[i] != 0;
            clipped[i] = (on && l2 > l1) ? 1.0f : 0.0f;
            count += on && c1 > l3;
        }
        lower[row] = (double)count;
    }
    return 0;
}
