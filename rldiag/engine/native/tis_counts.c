/* The diagnostic token-level TIS weights' exact statistics of a step in one read
 * (rldiag/engine/diag_is.py, tis_statistics, whose torch and numpy twin makes six passes): the
 * raw weights w = exp(clamp(d)) made 0 off the mask in place (w m, torch's mul_), how many are
 * above `up` and below `lo` (verl's rollout_is_ratio_fraction_high / _low, before truncation),
 * then each weight truncated in place to `cap` (torch.clamp_(max=cap): a NaN stays), and of the
 * truncated weights the largest over the step and the least over its actor tokens (mask above 0;
 * `cap` where it has none). A product, counts, a clamp and extrema: exact, so the same values as
 * the twin's in any order. (A NaN weight is left out of the extrema: the caller takes the general
 * path for any weight not finite.)
 *
 * In the same read, the log-ratios' products with the mask (the terms of the rows' masked sums,
 * torch's values * mask). Then rldiag_tis_spread: the terms of the standard deviation and of the
 * effective sample size, token by token, by the same float32 operations in the same order as the
 * twin's torch ones (a difference, a product, a quotient: IEEE, without contraction), so the same
 * bits, in one read where torch makes five passes.
 *
 * Then rldiag_tis_sequence: the sequence level's statistics from the rows' values, each a float64
 * or float32 operation of the numpy twin's (diag_is._sequence_table) in its order, so the same bits:
 * one call where numpy makes about thirty, each a microsecond or more on arrays of a few thousand rows.
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

int rldiag_tis_abi(void) { return 4; }

int rldiag_tis_fields(void) { return N_OUT; }

/* w: (n,) float32 exp(clamp(d)), multiplied by the mask and truncated in place; fmask: the
 * float32 mask, else bmask its bytes; d: (n,) float32 the log-ratios, whose products d m go to dm
 * (the rows' masked sums' terms), or NULL. Out:
 * (N_OUT,) float64: the counts above up and below lo, the largest truncated weight (-inf for
 * n = 0) and the least on the mask (cap where none). Returns 0. */
__attribute__((target_clones("avx2", "default")))
long rldiag_tis_counts(float *w, const float *fmask, const uint8_t *bmask, long n, float up, float lo, float cap,
                       const float *d, float *dm, double *out) {
    v8i above = {0, 0, 0, 0, 0, 0, 0, 0}, below = above;
    v8f mx = splat8(-INFINITY), mn = splat8(cap);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f x, m = mask8(fmask, bmask, i);
        memcpy(&x, w + i, sizeof x);
        x = x * m;
        if (d != NULL) {
            v8f v;
            memcpy(&v, d + i, sizeof v);
            v = v * m;
            memcpy(dm + i, &v, sizeof v);
        }
        above += x > splat8(up); /* a true lane is -1 */
        below += x < splat8(lo);
        x = select8(x > splat8(cap), splat8(cap), x);
        memcpy(w + i, &x, sizeof x);
        mx = select8(x > mx, x, mx);
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
        float m = fmask != NULL ? fmask[i] : (float)bmask[i];
        float x = w[i] * m;
        if (d != NULL) {
            dm[i] = d[i] * m;
        }
        na += x > up;
        nb += x < lo;
        x = x > cap ? cap : x;
        w[i] = x;
        fmx = x > fmx ? x : fmx;
        fmn = (m > 0.0f && x < fmn) ? x : fmn;
    }
    out[O_ABOVE] = (double)na;
    out[O_BELOW] = (double)nb;
    out[O_MAX] = fmx;
    out[O_MIN] = fmn;
    return 0;
}

/* w: (n,) float32 a step's truncated weights (0 off the mask); mean, den: the step's mean weight
 * and mean + 1e-8, float32. Out: (n,) float32 each, dev: (w - mean)^2 m (m the mask, as
 * rldiag_tis_counts reads it), norm: (w / den)^2. Returns 0. */
__attribute__((target_clones("avx2", "default")))
long rldiag_tis_spread(const float *w, const float *fmask, const uint8_t *bmask, long n, float mean, float den,
                       float *dev, float *norm) {
    long i = 0;
    const v8f vmean = splat8(mean), vden = splat8(den);
    for (; i + 8 <= n; i += 8) {
        v8f x, q;
        memcpy(&x, w + i, sizeof x);
        q = x / vden;
        q = q * q;
        x = x - vmean;
        x = (x * x) * mask8(fmask, bmask, i);
        memcpy(dev + i, &x, sizeof x);
        memcpy(norm + i, &q, sizeof q);
    }
    for (; i < n; i++) {
        float x = w[i] - mean, q = w[i] / den;
        dev[i] = (x * x) * (fmask != NULL ? fmask[i] : (float)bmask[i]);
        norm[i] = q * q;
    }
    return 0;
}

/* numpy's minimum and maximum: NaN if either is */
static float min_nan(float a, float b) { return (a != a || b != b) ? NAN : (a < b ? a : b); }
static float max_nan(float a, float b) { return (a != a || b != b) ? NAN : (a > b ? a : b); }
static double max0_nan(double v) { return v != v ? v : (v > 0.0 ? v : 0.0); }

/* The sequence level per step, over rows in step order. ratio: (rows,) float32 each row's
 * exp(clamp(summed log-ratio)); lr: (rows,) float32 the summed log-ratio; c: (rows,) float32 its
 * actor tokens; sid: (rows,) int64 its step, ascending, in [0, n); count: (n,) float32 the steps'
 * actor tokens; cap: the threshold; log_up, log_lo: log(cap) and log(1 / cap) as float32; eps: the
 * means' 1e-8. scratch: (n,) float64. Out: (7, n) float32: the mean, std and effective sample size
 * of the weights min(ratio, cap) over the step's actor tokens (each row's weight on its c tokens;
 * float64 sums in the rows' order), the shares of rows whose log-ratio is above log_up and below
 * log_lo, the largest and least log-ratio (NaN for a step without rows). Returns 0, or -1 where the
 * rows are not in step order. */
long rldiag_tis_sequence(const float *ratio, const float *lr, const float *c, const int64_t *sid, long rows,
                         const float *count, long n, float cap, float log_up, float log_lo, double eps,
                         double *scratch, float *out) {
    float *o_mean = out, *o_std = out + n, *o_ess = out + 2 * n, *o_high = out + 3 * n, *o_low = out + 4 * n;
    float *o_max = out + 5 * n, *o_min = out + 6 * n;
    double *mean = scratch;
    for (long s = 0; s < n; s++) {
        mean[s] = 0.0;
        o_max[s] = o_min[s] = NAN;
    }
    for (long r = 0; r < rows; r++) { /* bincount's sums: in the rows' order, from 0 */
        mean[sid[r]] += (double)c[r] * (double)min_nan(ratio[r], cap);
    }
    for (long s = 0; s < n; s++) {
        mean[s] = mean[s] / ((double)count[s] + eps);
    }
    long r = 0;
    for (long s = 0; s < n; s++) {
        double var = 0.0, norm2 = 0.0, high = 0.0, low = 0.0, nrows = 0.0;
        const double m = mean[s], den = (double)count[s] + eps, mden = m + eps;
        long first = r;
        for (; r < rows && sid[r] == s; r++) {
            double w = (double)min_nan(ratio[r], cap), cr = (double)c[r];
            double dv = w - m, q = w / mden;
            var += (dv * dv) * cr;
            norm2 += (q * q) * cr;
            high += lr[r] > log_up ? 1.0 : 0.0;
            low += lr[r] < log_lo ? 1.0 : 0.0;
            nrows += 1.0;
            if (r == first) {
                o_max[s] = o_min[s] = lr[r];
            } else {
                o_max[s] = max_nan(o_max[s], lr[r]);
                o_min[s] = min_nan(o_min[s], lr[r]);
            }
        }
        var = var / den;
        norm2 = norm2 / den;
        o_mean[s] = (float)m;
        o_std[s] = count[s] > 1.0f ? (float)sqrt(max0_nan(var)) : 0.0f;
        o_ess[s] = (float)(1.0 / norm2);
        o_high[s] = (float)high / (float)nrows;
        o_low[s] = (float)low / (float)nrows;
    }
    return r == rows ? 0 : -1;
}
