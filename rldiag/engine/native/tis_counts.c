/* The diagnostic token-level TIS weights' exact statistics of a step in one read
 * (rldiag/engine/diag_is.py, tis_statistics, whose torch and numpy twin makes five passes): of
 * the raw weights w (0 off the mask), how many are above `up` and below `lo` (verl's
 * rollout_is_ratio_fraction_high / _low, before truncation), then each weight truncated in place
 * to `cap` (torch.clamp_(max=cap): a NaN stays), and of the truncated weights the largest over
 * the step and the least over its actor tokens (mask above 0; `cap` where it has none). Counts,
 * a clamp and extrema: exact, so the same values as the twin's in any order. (A NaN weight is
 * left out of the extrema: the caller takes the general path for any weight not finite.)
 *
 * Eight float32 lanes at a time (lanes.h), the last tokens one by one. Plain C loaded through
 * ctypes (rldiag/engine/diag_is_native.py), built like mismatch_chunk.c.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"

enum { O_ABOVE, O_BELOW, O_MAX, O_MIN, N_OUT };

int rldiag_tis_abi(void) { return 1; }

int rldiag_tis_fields(void) { return N_OUT; }

/* w: (n,) float32, truncated in place; fmask: the float32 mask, else bmask its bytes. Out:
 * (N_OUT,) float64: the counts above up and below lo, the largest truncated weight (-inf for
 * n = 0) and the least on the mask (cap where none). Returns 0. */
__attribute__((target_clones("avx2", "default")))
long rldiag_tis_counts(float *w, const float *fmask, const uint8_t *bmask, long n, float up, float lo, float cap,
                       double *out) {
    v8i above = {0, 0, 0, 0, 0, 0, 0, 0}, below = above;
    v8f mx = splat8(-INFINITY), mn = splat8(cap);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f x, m;
        memcpy(&x, w + i, sizeof x);
        above += x > splat8(up); /* a true lane is -1 */
        below += x < splat8(lo);
        x = select8(x > splat8(cap), splat8(cap), x);
        memcpy(w + i, &x, sizeof x);
        mx = select8(x > mx, x, mx);
        if (fmask != NULL) {
            memcpy(&m, fmask + i, sizeof m);
        } else {
            v8b b;
            memcpy(&b, bmask + i, sizeof b);
            m = __builtin_convertvector(b, v8f);
        }
        mn = select8((m > splat8(0.0f)) & (x < mn), x, mn);
    }
    long long na = 0, nb = 0;
    float fmx = -INFINITY, fmn = cap;
    for (int l = 0; l < 8; l++) {
        na -= above[l];
        nb -= below[l];
        fmx = mx[l] > fmx ? mx[l] : fmx;
        fmn = mn[l] < fmn ? mn[l] : fmn;
    }
    for (; i < n; i++) {
        float x = w[i];
        na += x > up;
        nb += x < lo;
        x = x > cap ? cap : x;
        w[i] = x;
        fmx = x > fmx ? x : fmx;
        float m = fmask != NULL ? fmask[i] : (float)bmask[i];
        fmn = (m > 0.0f && x < fmn) ? x : fmn;
    }
    out[O_ABOVE] = (double)na;
    out[O_BELOW] = (double)nb;
    out[O_MAX] = fmx;
    out[O_MIN] = fmn;
    return 0;
}
