/* verl's comparison of the trainer's and the rollout engine's token probabilities
 * (training/rollout_probs_diff_{max,mean,std} and training/rollout_actor_probs_pearson_corr,
 * verl/utils/debug/metrics.py, calculate_debug_metrics) per step, in one read of the two
 * log-prob streams and the mask, where torch makes about 25 passes over token-sized float32
 * tensors (rldiag/engine/metrics.py, rollout_probs_metrics, its twin).
 *
 * As verl: p = exp(log p) in float32 (here lanes.h's eight-lane vexp8f, within one unit in the
 * last place, as torch's own; the two differ in that unit on about 10 % of tokens) and
 * |p_old - p_rollout| in float32; then every sum in float64. A row is read in blocks of BLOCK
 * tokens: each block's weighted means and centred sums of squares and products (two passes over
 * the block, in the first-level cache), merged into its step's by the pairwise update of Chan,
 * Golub and LeVeque ("Algorithms for computing the sample variance", 1983), so that the step's
 * variances are centred without a second read of its tokens. A token counts with its mask's
 * weight where the mask is not 0 (a 0/1 mask: a count); a NaN or an infinity off the mask goes
 * nowhere (a select, not a product).
 *
 * Plain C loaded through ctypes (rldiag/engine/probs_native.py), built like mismatch_chunk.c:
 * IEEE float64 in the source's order, no contraction, the same bits on every run.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"

#define BLOCK 128

/* the output's fields per step, in this order */
enum { O_N, O_DIFF_MEAN, O_DIFF_M2, O_DIFF_MAX, O_OLD_MEAN, O_ROLL_MEAN, O_OLD_M2, O_ROLL_M2, O_CROSS, N_OUT };

int rldiag_probs_abi(void) { return 1; }

int rldiag_probs_fields(void) { return N_OUT; }

/* a step's running totals: weight, means, centred sums of squares and the cross-product */
typedef struct {
    double n, mean[3], m2[3], cross, max;
} Acc;

/* Chan et al.'s update: `acc` merged with a block of weight nb, means mb, centred sums m2b, cb */
INLINE void merge(Acc *acc, double nb, const double *mb, const double *m2b, double cb, double maxb) {
    if (nb == 0.0) {
        return;
    }
    if (acc->n == 0.0) {
        acc->n = nb;
        for (int i = 0; i < 3; i++) {
            acc->mean[i] = mb[i];
            acc->m2[i] = m2b[i];
        }
        acc->cross = cb;
        acc->max = maxb;
        return;
    }
    double n = acc->n + nb, w = acc->n * nb / n, delta[3];
    for (int i = 0; i < 3; i++) {
        delta[i] = mb[i] - acc->mean[i];
        acc->m2[i] += m2b[i] + w * delta[i] * delta[i];
        acc->mean[i] += delta[i] * (nb / n);
    }
    acc->cross += cb + w * delta[1] * delta[2];
    acc->n = n;
    acc->max = maxb > acc->max ? maxb : acc->max;
}

/* x, y: (tokens,) float32 log-probs (trainer, rollout); fmask: (tokens,) the float32 mask, else
 * flags: (tokens,) its 0/1 bytes; offsets: (n_rows + 1,) the rows' token offsets; row_step:
 * (n_rows,) each row's step in [0, n_steps). Out: (n_steps, N_OUT) float64: per step the summed
 * weight, and of diff = |p_old - p_rollout|, p_old and p_rollout (float32 values): the weighted
 * means and centred sums of squares, the centred sum of products of p_old and p_rollout, and the
 * largest diff (-inf without a token). Returns 0, or -1 for a row's step out of range. */
__attribute__((target_clones("avx2", "default")))
long rldiag_rollout_probs(const float *x, const float *y, const float *fmask, const uint8_t *flags,
                          const int64_t *offsets, const int64_t *row_step, long n_rows, long n_steps,
                          double *out) {
    for (long s = 0; s < n_steps; s++) {
        double *o = out + s * N_OUT;
        memset(o, 0, N_OUT * sizeof(double));
        o[O_DIFF_MAX] = -INFINITY;
    }
    double bd[BLOCK], bo[BLOCK], br[BLOCK], bw[BLOCK];
    float fx[BLOCK], fy[BLOCK], fm[BLOCK]; /* BLOCK a multiple of 8 */
    const v4d zero = {0.0, 0.0, 0.0, 0.0};
    for (long r = 0; r < n_rows; r++) {
        long s = (long)row_step[r];
        if (s < 0 || s >= n_steps) {
            return -1;
        }
        /* the step's totals live in its output row while the rows are read */
        double *o = out + s * N_OUT;
        Acc acc;
        acc.n = o[O_N];
        acc.mean[0] = o[O_DIFF_MEAN];
        acc.mean[1] = o[O_OLD_MEAN];
        acc.mean[2] = o[O_ROLL_MEAN];
        acc.m2[0] = o[O_DIFF_M2];
        acc.m2[1] = o[O_OLD_M2];
        acc.m2[2] = o[O_ROLL_M2];
        acc.cross = o[O_CROSS];
        acc.max = o[O_DIFF_MAX];
        for (long b0 = offsets[r]; b0 < offsets[r + 1]; b0 += BLOCK) {
            long len = offsets[r + 1] - b0 < BLOCK ? offsets[r + 1] - b0 : BLOCK;
            long k = (len + 3) & ~3L;
            memcpy(fx, x + b0, len * sizeof(float));
            memcpy(fy, y + b0, len * sizeof(float));
            if (fmask != NULL) {
                memcpy(fm, fmask + b0, len * sizeof(float));
            } else if (flags != NULL) {
                for (long j = 0; j < len; j++) {
                    fm[j] = (float)flags[b0 + j];
                }
            } else {
                for (long j = 0; j < len; j++) {
                    fm[j] = 1.0f;
                }
            }
            for (long j = len; j < ((len + 7) & ~7L); j++) { /* the padding: off the mask */
                fx[j] = fy[j] = fm[j] = 0.0f;
            }
            /* the block's probabilities in float32, eight lanes at a time, in place */
            for (long j = 0; j < len; j += 8) {
                v8f v;
                memcpy(&v, fx + j, sizeof v);
                v = vexp8f(v);
                memcpy(fx + j, &v, sizeof v);
                memcpy(&v, fy + j, sizeof v);
                v = vexp8f(v);
                memcpy(fy + j, &v, sizeof v);
            }
            /* the probabilities in float32, their gap, each token's weight (0 off the mask, where
             * the values are 0 too: a NaN there goes nowhere), and the block's weighted sums */
            v4d sw = zero, sd = zero, so = zero, sr = zero;
            v4d mx = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
            for (long j = 0; j < k; j += 4) {
                v4f xf, yf, mf;
                memcpy(&xf, fx + j, sizeof xf);
                memcpy(&yf, fy + j, sizeof yf);
                memcpy(&mf, fm + j, sizeof mf);
                v4f po = xf, pr = yf;
                v4f df = po - pr;
                df = (v4f)((v4i)df & 0x7FFFFFFF); /* |p_old - p_rollout| in float32, as verl */
                v4l on = __builtin_convertvector(mf != 0.0f, v4l);
                v4d w = and_(__builtin_convertvector(mf, v4d), on);
                v4d d = and_(__builtin_convertvector(df, v4d), on), vo = and_(__builtin_convertvector(po, v4d), on),
                    vr = and_(__builtin_convertvector(pr, v4d), on);
                memcpy(bd + j, &d, sizeof d);
                memcpy(bo + j, &vo, sizeof vo);
                memcpy(br + j, &vr, sizeof vr);
                memcpy(bw + j, &w, sizeof w);
                sw += w;
                sd += w * d;
                so += w * vo;
                sr += w * vr;
                v4d dm = (v4d)(((v4l)d & on) | ((v4l)(v4d){-INFINITY, -INFINITY, -INFINITY, -INFINITY} & ~on));
                v4l more = dm > mx; /* a NaN gap on the mask: kept by the max below */
                v4l nan = dm != dm;
                mx = (v4d)(((v4l)dm & (more | nan)) | ((v4l)mx & ~(more | nan)));
            }
            double nb = lanes(sw);
            if (nb == 0.0) {
                continue;
            }
            double mb[3] = {lanes(sd) / nb, lanes(so) / nb, lanes(sr) / nb};
            const v4d m0 = {mb[0], mb[0], mb[0], mb[0]}, m1 = {mb[1], mb[1], mb[1], mb[1]},
                      m2v = {mb[2], mb[2], mb[2], mb[2]};
            v4d qd = zero, qo = zero, qr = zero, qc = zero;
            for (long j = 0; j < k; j += 4) {
                v4d w = load(bw + j);
                v4l on = w != zero;
                v4d u = and_(load(bd + j) - m0, on), vo = and_(load(bo + j) - m1, on), vr = and_(load(br + j) - m2v, on);
                qd += w * u * u;
                qo += w * vo * vo;
                qr += w * vr * vr;
                qc += w * vo * vr;
            }
            double m2b[3] = {lanes(qd), lanes(qo), lanes(qr)};
            double maxb = mx[0];
            for (int l = 1; l < 4; l++) {
                maxb = (mx[l] > maxb || mx[l] != mx[l]) ? mx[l] : maxb;
            }
            merge(&acc, nb, mb, m2b, lanes(qc), maxb);
        }
        o[O_N] = acc.n;
        o[O_DIFF_MEAN] = acc.mean[0];
        o[O_OLD_MEAN] = acc.mean[1];
        o[O_ROLL_MEAN] = acc.mean[2];
        o[O_DIFF_M2] = acc.m2[0];
        o[O_OLD_M2] = acc.m2[1];
        o[O_ROLL_M2] = acc.m2[2];
        o[O_CROSS] = acc.cross;
        o[O_DIFF_MAX] = acc.max;
    }
    return 0;
}
