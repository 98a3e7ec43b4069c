/* One read of a chunk of a step's tokens for the mismatch fingerprints
 * (rldiag/engine/mismatch_scan.py, `scan_chunk` with plain sums of products): every sum, product
 * sum, count, adjacent-pair sum and the tokens for the order statistics, in one loop over the
 * chunk's trainer (x) and rollout (y) log-probs, where numpy needs about 35 array passes.
 *
 * Plain C, loaded through ctypes (rldiag/engine/mismatch_native.py): no Python API, so it holds
 * no GIL and needs only a C compiler at install time. Built without fast-math or contraction
 * (-ffp-contract=off, see setup.py): every operation is IEEE float64, in a fixed order, so the
 * results are the same bits on every run and thread count.
 *
 * Sums: each series is summed in blocks of BLOCK tokens, each block's sum added to the chunk's
 * (two levels: about sqrt(BLOCK) + sqrt(chunk / BLOCK) roundings on average, as a pairwise sum).
 *
 * The record's layout is rldiag/engine/mismatch_scan.py's FIELDS, in that order; `exp` (the sum
 * of exp|d|) is left to the caller, which takes numpy's vectorised exp over the |d| written to
 * `a_out` (glibc's scalar exp costs about 6 ns a token here, numpy's about 1.4).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    F_N, F_S_D, F_S_Y, F_S_P, F_S_A, F_S_YA, F_S_X,
    F_M_DD, F_M_DY, F_M_YY, F_M_AA, F_M_AP, F_M_PP, F_M_AYA, F_M_YAYA, F_M_XX, F_M_XY,
    F_D2, F_N_CONF, F_D_CONF, F_N_UNCONF, F_D_UNCONF, F_EXP, F_EXTREME, F_HALF,
    F_PAIRS, F_PAIR_ABS, F_SHIFT_NEXT, F_SHIFT_PREV,
    N_FIELDS
};

/* the series summed per token: d, y, p, |d|, |y|, dd, dy, yy, |d|p, pp, |d||y|,
 * d where confident, d where unconfident, and the adjacent pairs' |d|+|d'|, |y - x'|, |y' - x| */
enum { S_D, S_Y, S_P, S_A, S_YA, S_DD, S_DY, S_YY, S_AP, S_PP, S_AYA, S_DC, S_DU,
       S_PA, S_SN, S_SP, N_SUMS };

#define BLOCK 256

static inline int finite32(float v) { return isfinite(v); }

int rldiag_mismatch_fields(void) { return N_FIELDS; }

/* x, y: (me,) float32; flags: (me,) 0/1 (mask > 0), or NULL where every token's mask is;
 * m: the chunk's tokens, me: m or m + 1 (the next token of the same run, read for the pair the
 * chunk's last token starts); starts: (n_starts,) the row starts inside (0, me), ascending;
 * origin: the first token's row start, relative to the chunk (<= 0); threshold: keep the
 * tokens whose |d| reaches it (above 0 where it is <= 0); confident, unconfident, extreme,
 * half_min, half_max: the thresholds of mismatch_scan.py.
 * Out: rec (N_FIELDS,) (F_EXP left 0), a_out (m,) |d| (0 off the actor tokens), pick_d,
 * pick_y (capacity m): the kept tokens' d and y, in order. Returns how many were kept. */
long rldiag_mismatch_chunk(const float *x, const float *y, const uint8_t *flags, long m, long me,
                           const long *starts, long n_starts, long origin, double threshold,
                           double confident, double unconfident, double extreme,
                           double half_min, double half_max,
                           double *rec, double *a_out, double *pick_d, double *pick_y) {
    double total[N_SUMS], part[N_SUMS];
    memset(total, 0, sizeof total);
    memset(part, 0, sizeof part);
    long n = 0, n_conf = 0, n_unconf = 0, n_extreme = 0, n_half = 0, n_pairs = 0, kept = 0;
    long next_i = 0;
    long next_start = n_starts > 0 ? starts[0] : me;
    long org = origin;
    int keep_zero = threshold <= 0.0;
    /* the previous token's values, for the pair (t - 1, t) */
    int prev_actor = 0;
    double prev_x = 0.0, prev_y = 0.0, prev_a = 0.0;
    for (long i = 0; i < me; i++) {
        int row_start = 0;
        while (i == next_start) { /* empty rows start where the next one does */
            row_start = 1;
            org = i;
            next_i++;
            next_start = next_i < n_starts ? starts[next_i] : me;
        }
        float xf = x[i], yf = y[i];
        int actor = (flags == NULL || flags[i]) && finite32(xf) && finite32(yf);
        double xv = (double)xf, yv = (double)yf;
        double d = actor ? xv - yv : 0.0;
        double a = fabs(d);
        if (i > 0 && prev_actor && actor && !row_start) {
            n_pairs++;
            part[S_PA] += prev_a + a;
            part[S_SN] += fabs(prev_y - xv);
            part[S_SP] += fabs(yv - prev_x);
        }
        prev_actor = actor;
        prev_x = xv;
        prev_y = yv;
        prev_a = a;
        if (i >= m) {
            break; /* the next run's token: its pair only */
        }
        a_out[i] = a;
        if (actor) {
            double p = (double)(i - org);
            double ya = fabs(yv);
            n++;
            part[S_D] += d;
            part[S_Y] += yv;
            part[S_P] += p;
            part[S_A] += a;
            part[S_YA] += ya;
            part[S_DD] += d * d;
            part[S_DY] += d * yv;
            part[S_YY] += yv * yv;
            part[S_AP] += a * p;
            part[S_PP] += p * p;
            part[S_AYA] += a * ya;
            if (yv >= confident) {
                n_conf++;
                part[S_DC] += d;
            }
            if (yv < unconfident) {
                n_unconf++;
                part[S_DU] += d;
            }
            if (a > extreme) {
                n_extreme++;
            }
            /* a 16-bit float: the float32's low 13 bits 0, and a bfloat16 (low 16 bits 0,
             * non-zero) or a normal float16 (|y| in its normal range) */
            uint32_t bits;
            memcpy(&bits, &yf, sizeof bits);
            if ((bits & 0x1FFFu) == 0u) {
                int bf16 = (bits & 0xFFFFu) == 0u && ya != 0.0;
                int fp16 = ya >= half_min && ya <= half_max;
                if (bf16 || fp16) {
                    n_half++;
                }
            }
            if (keep_zero ? a > 0.0 : a >= threshold) {
                pick_d[kept] = d;
                pick_y[kept] = yv;
                kept++;
            }
        }
        if ((i + 1) % BLOCK == 0) {
            for (int s = 0; s < N_SUMS; s++) {
                total[s] += part[s];
                part[s] = 0.0;
            }
        }
    }
    for (int s = 0; s < N_SUMS; s++) {
        total[s] += part[s];
    }
    double dd = total[S_DD], dy = total[S_DY], yy = total[S_YY];
    rec[F_N] = (double)n;
    rec[F_S_D] = total[S_D];
    rec[F_S_Y] = total[S_Y];
    rec[F_S_P] = total[S_P];
    rec[F_S_A] = total[S_A];
    rec[F_S_YA] = total[S_YA];
    rec[F_S_X] = total[S_D] + total[S_Y];
    /* |d|^2 = d^2, |y|^2 = y^2, x = d + y: their plain sums are these */
    rec[F_M_DD] = dd;
    rec[F_M_DY] = dy;
    rec[F_M_YY] = yy;
    rec[F_M_AA] = dd;
    rec[F_M_AP] = total[S_AP];
    rec[F_M_PP] = total[S_PP];
    rec[F_M_AYA] = total[S_AYA];
    rec[F_M_YAYA] = yy;
    rec[F_M_XX] = dd + 2.0 * dy + yy;
    rec[F_M_XY] = dy + yy;
    rec[F_D2] = dd;
    rec[F_N_CONF] = (double)n_conf;
    rec[F_D_CONF] = total[S_DC];
    rec[F_N_UNCONF] = (double)n_unconf;
    rec[F_D_UNCONF] = total[S_DU];
    rec[F_EXP] = 0.0;
    rec[F_EXTREME] = (double)n_extreme;
    rec[F_HALF] = (double)n_half;
    rec[F_PAIRS] = (double)n_pairs;
    rec[F_PAIR_ABS] = total[S_PA];
    rec[F_SHIFT_NEXT] = total[S_SN];
    rec[F_SHIFT_PREV] = total[S_SP];
    return kept;
}
