/* One read of a chunk of a step's tokens for the mismatch fingerprints
 * (rldiag/engine/mismatch_scan.py, `scan_chunk` with plain sums of products): every sum, product
 * sum, count, adjacent-pair sum and the tokens for the order statistics, in one loop over the
 * chunk's trainer (x) and rollout (y) log-probs, where numpy needs about 35 array passes.
 *
 * A chunk is read in blocks of BLOCK tokens, eight lanes of float64 at a time (mismatch_block.h:
 * one AVX-512 vector where the processor has AVX-512, else two four-lane ones, AVX2's or SSE2's
 * pairs: the same operations in the same order, so the same bits; the AVX-512 blocks take about
 * 0.7 of the four-lane ones' time here, docs/performance.md). A token off the actor mask (mask 0
 * or a log-prob not finite) is 0 in every series by a bitwise AND with its lane's mask, never a
 * branch, so that a NaN or an infinity goes nowhere.
 *
 * Plain C, loaded through ctypes (rldiag/engine/mismatch_native.py): no Python API, so it holds
 * no GIL and needs only a C compiler at install time. Built without fast-math or contraction
 * (-ffp-contract=off, see setup.py): every operation is IEEE float64, in a fixed order, so the
 * results are the same bits on every run, thread count and processor.
 *
 * Sums: each series is summed in eight lanes over a block, the lanes added in a fixed order and
 * each block's sum added to the chunk's (two levels: about sqrt(BLOCK / 8) + sqrt(chunk / BLOCK)
 * roundings on average, as a pairwise sum).
 *
 * The record's layout is rldiag/engine/mismatch_scan.py's FIELDS, in that order. exp|d| is
 * lanes.h's: its Taylor series without range reduction up to |d| = 1/8 (most tokens), vexp
 * above (glibc's scalar exp costs about 6 ns a token here), each within 2 units in the last place.
 *
 * After the pass, a step's order statistics from its picked tokens (about 8 % of them):
 * rldiag_mismatch_select, a radix selection, and rldiag_mismatch_above, the sums of the tokens
 * above the 95th percentile (rldiag/engine/mismatch.py's _tails and _excluded_body, whose numpy
 * twins select with np.partition).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "lanes.h"

enum {
    F_N, F_S_D, F_S_Y, F_S_P, F_S_A, F_S_YA, F_S_X,
    F_M_DD, F_M_DY, F_M_YY, F_M_AA, F_M_AP, F_M_PP, F_M_AYA, F_M_YAYA, F_M_XX, F_M_XY,
    F_D2, F_N_CONF, F_D_CONF, F_N_UNCONF, F_D_UNCONF, F_EXP, F_EXTREME, F_HALF,
    F_PAIRS, F_PAIR_ABS, F_SHIFT_NEXT, F_SHIFT_PREV,
    N_FIELDS
};

/* the series summed per token: d, y, p, |d|, |y|, dd, dy, yy, |d|p, pp, |d||y|,
 * d where confident, d where unconfident, the adjacent pairs' |d|+|d'|, |y - x'|, |y' - x|, exp|d| */
enum { S_D, S_Y, S_P, S_A, S_YA, S_DD, S_DY, S_YY, S_AP, S_PP, S_AYA, S_DC, S_DU,
       S_PA, S_SN, S_SP, S_EXP, N_SUMS };

#define BLOCK 128

int rldiag_mismatch_fields(void) { return N_FIELDS; }

/* this kernel's calling convention: raised with every change to rldiag_mismatch_chunk's
 * arguments, so that a library built from other sources is not called */
int rldiag_mismatch_abi(void) { return 7; }

/* COMPRESS[bits]: the float32-pair indices that move a quad's doubles whose bit is set in bits
 * to its front, in order (the others after them) */
#define P(i) 2 * (i), 2 * (i) + 1
static const v8i COMPRESS[16] = {
    {P(0), P(1), P(2), P(3)}, {P(0), P(1), P(2), P(3)}, {P(1), P(0), P(2), P(3)}, {P(0), P(1), P(2), P(3)},
    {P(2), P(0), P(1), P(3)}, {P(0), P(2), P(1), P(3)}, {P(1), P(2), P(0), P(3)}, {P(0), P(1), P(2), P(3)},
    {P(3), P(0), P(1), P(2)}, {P(0), P(3), P(1), P(2)}, {P(1), P(3), P(0), P(2)}, {P(0), P(1), P(3), P(2)},
    {P(2), P(3), P(0), P(1)}, {P(0), P(2), P(3), P(1)}, {P(1), P(2), P(3), P(0)}, {P(0), P(1), P(2), P(3)},
};
#undef P

/* p[j] = first + (j - j0) for j in [j0, j1): four at a time between the multiples of 4 */
INLINE void fill_iota(double *p, long j0, long j1, double first) {
    long j = j0;
    for (; j < j1 && (j & 3); j++) {
        p[j] = first + (double)(j - j0);
    }
    if (j + 4 <= j1) {
        double f = first + (double)(j - j0);
        v4d v = {f, f + 1.0, f + 2.0, f + 3.0};
        const v4d four = {4.0, 4.0, 4.0, 4.0};
        for (; j + 4 <= j1; j += 4) {
            memcpy(p + j, &v, sizeof v);
            v += four;
        }
    }
    for (; j < j1; j++) {
        p[j] = first + (double)(j - j0);
    }
}

/* One chunk's buffers: a block's series (0 off the actor tokens), and for the pairs each
 * token's x, y, |d| and lane mask one place on, [0] holding the previous block's last token. */
typedef struct {
    double d[BLOCK], y[BLOCK], p[BLOCK], a[BLOCK];
    double px[BLOCK + 1], py[BLOCK + 1], pa[BLOCK + 1];
    long long act[BLOCK + 1], rs[BLOCK + 1];
    float fx[BLOCK], fy[BLOCK];
    uint8_t ff[BLOCK];
} Block;

/* one block's series and sums (mismatch_block.h), for eight lanes in one AVX-512 vector or two
 * four-lane ones: the same bits */
#define W 8
#define BLOCK_FN block_w8
#define BLOCK_ATTR static __attribute__((target("arch=x86-64-v4"), noinline))
#include "mismatch_block.h"
#undef W
#undef BLOCK_FN
#undef BLOCK_ATTR
#define W 4
#define BLOCK_FN block_w4
#define BLOCK_ATTR INLINE
#include "mismatch_block.h"
#undef W
#undef BLOCK_FN
#undef BLOCK_ATTR

/* whether this processor runs block_w8: AVX-512's F, VL, DQ, BW and CD (x86-64-v4); the
 * environment's RLDIAG_NATIVE_LANES=4 takes the four-lane blocks anyway (the tests compare both) */
static int wide_lanes(void) {
    const char *lanes = getenv("RLDIAG_NATIVE_LANES");
    if (lanes != NULL && strcmp(lanes, "4") == 0) {
        return 0;
    }
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512cd");
}

/* the float64 lanes of a block's vectors on this processor (and environment): 8 or 4 */
int rldiag_mismatch_lanes(void) { return wide_lanes() ? 8 : 4; }

long rldiag_mismatch_sample(const float *x, const float *y, const uint8_t *flags, const float *fmask, long m,
                            long step, long run, double *out);
long rldiag_mismatch_select(const double *d, long n, const long *ranks, long n_ranks, long k, double extreme,
                            double *vals, double *top, uint64_t *keys, uint64_t *spare);

/* The threshold a step's first chunk sets (rldiag/engine/mismatch_scan.py's first_threshold and
 * threshold): of its first m tokens, runs of `run` every `step` sampled, and the value of rank
 * floor(n (1 - share)) of the n sampled |d| (0 below 64 of them). NaN: no memory. */
static double first_threshold(const float *x, const float *y, const uint8_t *flags, const float *fmask, long m,
                              long step, long run, double share) {
    long n = 0;
    for (long t0 = 0; t0 < m; t0 += step) {
        n += t0 + run < m ? run : m - t0;
    }
    if (n < 64) {
        return 0.0;
    }
    double *sample = malloc(n * sizeof(double));
    uint64_t *keys = malloc(2 * n * sizeof(uint64_t));
    double value = NAN, top[2];
    if (sample != NULL && keys != NULL) {
        rldiag_mismatch_sample(x, y, flags, fmask, m, step, run, sample);
        long j = (long)((double)n * (1.0 - share));
        j = j < n - 1 ? j : n - 1;
        rldiag_mismatch_select(sample, n, &j, 1, 0, INFINITY, &value, top, keys, keys + n);
    }
    free(sample);
    free(keys);
    return value;
}

/* x, y: (me,) float32; flags: (me,) 0/1 (mask > 0), else fmask: (me,) the float32 mask, else
 * both NULL where every token's mask is;
 * m: the chunk's tokens, me: m or m + 1 (the next token of the same run, read for the pair the
 * chunk's last token starts); starts: (n_starts,) the row starts inside (0, me), ascending
 * (repeated for empty rows); origin: the first token's row start, relative to the chunk
 * (<= 0); threshold: keep the tokens whose |d| reaches it (above 0 where it is <= 0);
 * confident, unconfident, extreme, half_min, half_max: the thresholds of mismatch_scan.py.
 * A threshold NaN: the step's first chunk, whose threshold is set from its own first first[0]
 * tokens (first_threshold: runs of first[2] tokens every first[1], their top share first[3]).
 * Out: used, the threshold; rec (N_FIELDS,), sample ((m + 7) / 8,): every 8th token's |d| (0 off the actor tokens)
 * as float32, pick_d, pick_y (capacity m + 8: each octet of tokens may write eight): the kept tokens' d and
 * y, in order. Returns how many
 * were kept (-1: no memory for the first threshold's sample). */
__attribute__((target_clones("avx2", "default")))
long rldiag_mismatch_chunk(const float *x, const float *y, const uint8_t *flags, const float *fmask,
                           long m, long me,
                           const long *starts, long n_starts, long origin, double threshold,
                           double confident, double unconfident, double extreme,
                           double half_min, double half_max,
                           double *rec, float *sample, double *pick_d, double *pick_y,
                           const double *first, double *used) {
    Block b;
    double total[N_SUMS];
    memset(total, 0, sizeof total);
    long long n = 0, n_conf = 0, n_unconf = 0, n_extreme = 0, n_half = 0, n_pairs = 0, off = 0;
    long kept = 0;
    long next_i = 0;
    long next_start = n_starts > 0 ? starts[0] : me;
    long org = origin;
    if (isnan(threshold)) { /* the step's first chunk: its threshold from its own sample */
        threshold = first_threshold(x, y, flags, fmask, (long)first[0], (long)first[1], (long)first[2], first[3]);
        if (isnan(threshold)) {
            return -1;
        }
    }
    *used = threshold;
    /* kept: |d| at least the threshold, or above 0 (at least the least double above 0) */
    const double least = threshold <= 0.0 ? nextafter(0.0, 1.0) : threshold;
    const double levels[3] = {confident, unconfident, extreme};
    const int wide = wide_lanes();
    /* the previous token (none before the chunk) */
    b.px[0] = b.py[0] = b.pa[0] = 0.0;
    b.act[0] = 0;
    for (long b0 = 0; b0 < m; b0 += BLOCK) {
        long len = b0 + BLOCK < m ? BLOCK : m - b0;
        long k = (len + 7) & ~7L; /* whole octets: the padding is off the actor mask */
        const float *bx = x + b0, *by = y + b0;
        const uint8_t *bf = flags == NULL ? NULL : flags + b0;
        const float *bm = fmask == NULL ? NULL : fmask + b0;
        if (k != len) { /* the chunk's last block: its padding is off the actor mask */
            memcpy(b.fx, bx, len * sizeof(float));
            memcpy(b.fy, by, len * sizeof(float));
            memset(b.ff, 0, k);
            if (bf != NULL) {
                memcpy(b.ff, bf, len);
            } else if (bm != NULL) {
                for (long j = 0; j < len; j++) {
                    b.ff[j] = bm[j] > 0.0f;
                }
            } else {
                memset(b.ff, 1, len);
            }
            for (long j = len; j < k; j++) {
                b.fx[j] = b.fy[j] = 0.0f;
            }
            bx = b.fx;
            by = b.fy;
            bf = b.ff;
            bm = NULL;
        }
        /* positions in rows, and where rows start (empty rows start where the next one does) */
        memset(b.rs + 1, 0, k * sizeof(long long));
        for (long j = len; j < k; j++) {
            b.p[j] = 0.0;
        }
        for (long j = 0; j < len;) {
            long end = next_start - b0 < len ? next_start - b0 : len;
            fill_iota(b.p, j, end, (double)(b0 + j - org));
            j = end > j ? end : j;
            if (j < len) {
                org = next_start;
                b.rs[j + 1] = -1;
                while (next_i < n_starts && starts[next_i] == next_start) {
                    next_i++;
                }
                next_start = next_i < n_starts ? starts[next_i] : me;
            }
        }
        long long counts[5] = {0};
        int half_any = wide ? block_w8(&b, bx, by, bf, bm, k, len, levels, total, counts, least, pick_d, pick_y, &kept)
                            : block_w4(&b, bx, by, bf, bm, k, len, levels, total, counts, least, pick_d, pick_y, &kept);
        n += counts[0];
        n_conf += counts[1];
        n_unconf += counts[2];
        n_extreme += counts[3];
        n_pairs += counts[4];
        off += k;
        for (long j = (8 - (b0 & 7)) & 7; j < k; j += 8) { /* every 8th token's |d| (b0 is a multiple of 8) */
            sample[(b0 + j) >> 3] = (float)b.a[j];
        }
        /* the last token, for the next block's first pair */
        b.px[0] = b.px[len];
        b.py[0] = b.py[len];
        b.pa[0] = b.pa[len];
        b.act[0] = b.act[len];
        /* the picked tokens where the four-lane block has not picked them (each quad's kept ones
         * moved to its front by one shuffle, all four written, the kept counted: about 8 % are, in
         * no order, and a branch on them cost a misprediction every few quads; block_w8 picks
         * eight at a time by AVX-512's compression) and the 16-bit values (the float32's low 13
         * bits 0, and a bfloat16: low 16 bits 0, non-zero, or a normal float16: |y| in its normal
         * range; y = 0 off the actor tokens counts in neither) */
        const v4d lv = {least, least, least, least};
        if (!wide) {
            for (long j = 0; j < k; j += 4) {
                v4l keep = load(b.a + j) >= lv; /* the padding's |d| is 0: never kept */
                v4l w = keep & (v4l){1, 2, 4, 8}; /* the lanes' bits, ORed across the lanes by two shuffles */
                w |= __builtin_shuffle(w, (v4l){2, 3, 0, 1});
                w |= __builtin_shuffle(w, (v4l){1, 0, 3, 2});
                int bits = (int)w[0];
                v8i order = COMPRESS[bits];
                v8i dv, yv;
                memcpy(&dv, b.d + j, sizeof dv);
                memcpy(&yv, b.y + j, sizeof yv);
                dv = __builtin_shuffle(dv, order);
                yv = __builtin_shuffle(yv, order);
                memcpy(pick_d + kept, &dv, sizeof dv); /* all four written: the kept ones first */
                memcpy(pick_y + kept, &yv, sizeof yv);
                kept += __builtin_popcount((unsigned)bits);
            }
        }
        if (half_any) {
            for (long j = 0; j < len; j++) {
                uint32_t bits;
                memcpy(&bits, by + j, sizeof bits);
                if ((bits & 0x1FFFu) == 0u) {
                    double ya = fabs(b.y[j]);
                    n_half += ((bits & 0xFFFFu) == 0u && ya != 0.0) || (ya >= half_min && ya <= half_max);
                }
            }
        }
    }
    if (me > m && m > 0) { /* the next run's first token: the pair the chunk's last token starts */
        float xf = x[m], yf = y[m];
        int masked = flags != NULL ? flags[m] != 0 : fmask != NULL ? fmask[m] > 0.0f : 1;
        int actor = masked && isfinite(xf) && isfinite(yf);
        if (actor && b.act[0] && next_start != m) {
            double xv = (double)xf, yv = (double)yf;
            n_pairs++;
            total[S_PA] += b.pa[0] + fabs(xv - yv);
            total[S_SN] += fabs(b.py[0] - xv);
            total[S_SP] += fabs(yv - b.px[0]);
        }
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
    rec[F_N_CONF] = (double)(n_conf - (off - n)); /* y = 0 off the actor tokens and in the padding */
    rec[F_D_CONF] = total[S_DC];
    rec[F_N_UNCONF] = (double)n_unconf;
    rec[F_D_UNCONF] = total[S_DU];
    rec[F_EXP] = total[S_EXP];
    rec[F_EXTREME] = (double)n_extreme;
    rec[F_HALF] = (double)n_half;
    rec[F_PAIRS] = (double)n_pairs;
    rec[F_PAIR_ABS] = total[S_PA];
    rec[F_SHIFT_NEXT] = total[S_SN];
    rec[F_SHIFT_PREV] = total[S_SP];
    return kept;
}

/* ---- the order statistics of a step's picked tokens ---- */

/* a double >= 0 (or NaN-free +0) as an unsigned integer of the same order */
INLINE uint64_t key_of(double v) {
    uint64_t k;
    v = fabs(v);
    memcpy(&k, &v, sizeof k);
    return k;
}

INLINE double value_of(uint64_t k) {
    double v;
    memcpy(&v, &k, sizeof v);
    return v;
}

#define RADIX 11
#define BUCKETS (1 << RADIX)

/* keys[0, n): out[i] = the key of rank ranks[i] (ascending ranks, each in [0, n)), radix by radix
 * from bit `shift` down, RADIX bits at a time: each radix's histogram gives each rank's bucket,
 * the buckets the ranks fall in are moved to `spare` in one pass (every other key to one spare
 * slot: no branch) and selected in the same way (`keys` is then their scratch). Below 24 keys,
 * or past the last radix, an insertion sort. */
static void select_keys(uint64_t *keys, long n, const long *ranks, long n_ranks, int shift, uint64_t *out,
                        uint64_t *spare) {
    if (n <= 24 || shift < 0) {
        for (long i = 1; i < n; i++) {
            uint64_t v = keys[i];
            long j = i - 1;
            for (; j >= 0 && keys[j] > v; j--) {
                keys[j + 1] = keys[j];
            }
            keys[j + 1] = v;
        }
        for (long i = 0; i < n_ranks; i++) {
            out[i] = keys[ranks[i]];
        }
        return;
    }
    /* four histograms, added after: a run of keys in one bucket is not one chain of increments */
    static __thread uint32_t part[4][BUCKETS];
    long count[BUCKETS], first[BUCKETS];
    int group_of[BUCKETS];
    const uint64_t digit = BUCKETS - 1;
    memset(part, 0, sizeof part);
    long i4 = 0;
    for (; i4 + 4 <= n; i4 += 4) {
        part[0][(keys[i4] >> shift) & digit]++;
        part[1][(keys[i4 + 1] >> shift) & digit]++;
        part[2][(keys[i4 + 2] >> shift) & digit]++;
        part[3][(keys[i4 + 3] >> shift) & digit]++;
    }
    for (; i4 < n; i4++) {
        part[0][(keys[i4] >> shift) & digit]++;
    }
    long acc = 0;
    for (int b = 0; b < BUCKETS; b++) {
        count[b] = ((long)part[0][b] + part[1][b]) + ((long)part[2][b] + part[3][b]);
        first[b] = acc;
        acc += count[b];
    }
    /* the groups: the ranks in one bucket (consecutive: the ranks ascend) */
    int bucket[66];
    long start[66], fill[66], local[65], upto[65];
    int n_groups = 0;
    long at = 0;
    int b = 0;
    for (long i = 0; i < n_ranks; i++) {
        while (first[b] + count[b] <= ranks[i]) {
            b++;
        }
        local[i] = ranks[i] - first[b];
        if (n_groups == 0 || bucket[n_groups - 1] != b) {
            bucket[n_groups] = b;
            start[n_groups] = at;
            fill[n_groups] = at;
            at += count[b];
            n_groups++;
        }
        upto[n_groups - 1] = i + 1;
    }
    int next = shift >= RADIX ? shift - RADIX : (shift > 0 ? 0 : -1);
    if (n_groups == 1 && count[bucket[0]] == n) { /* every key in one bucket: the next radix */
        select_keys(keys, n, ranks, n_ranks, next, out, spare);
        return;
    }
    /* the other keys all go to one slot past the groups' (there is one: not every key is in them) */
    for (int c = 0; c < BUCKETS; c++) {
        group_of[c] = n_groups;
    }
    for (int g = 0; g < n_groups; g++) {
        group_of[bucket[g]] = g;
    }
    start[n_groups] = fill[n_groups] = at < n ? at : n - 1;
    for (long i = 0; i < n; i++) {
        int g = group_of[(keys[i] >> shift) & digit];
        long pos = fill[g];
        spare[pos] = keys[i];
        fill[g] = pos + (g != n_groups);
    }
    long i0 = 0;
    for (int g = 0; g < n_groups; g++) {
        select_keys(spare + start[g], count[bucket[g]], local + i0, upto[g] - i0, next, out + i0, keys + start[g]);
        i0 = upto[g];
    }
}

/* The order statistics of the picked tokens d[0, n) by |d|: vals[i] = the |d| of ascending rank
 * ranks[i] (ranks ascending, at most 64, each in [0, n)); with k in [1, n]: top[0] = the summed
 * d^2 / 2 of the k largest |d| (four lanes, then the lanes), top[1] = how many |d| exceed `extreme`.
 * keys, spare: (n,) scratch. Returns 0, or -1 for ranks out of order or range. */
__attribute__((target_clones("avx2", "default")))
long rldiag_mismatch_select(const double *d, long n, const long *ranks, long n_ranks, long k, double extreme,
                            double *vals, double *top, uint64_t *keys, uint64_t *spare) {
    long r[65];
    uint64_t got[65];
    if (n_ranks > 64 || k < 0 || k > n) {
        return -1;
    }
    for (long i = 0; i < n_ranks; i++) {
        if (ranks[i] < 0 || ranks[i] >= n || (i > 0 && ranks[i] < ranks[i - 1])) {
            return -1;
        }
        r[i] = ranks[i];
    }
    long nr = n_ranks;
    if (k > 0) { /* the k-th largest: the top's edge */
        long e = n - k, j = nr;
        while (j > 0 && r[j - 1] > e) {
            r[j] = r[j - 1];
            j--;
        }
        r[j] = e;
        nr++;
    }
    /* the keys (|d|'s bits), four lanes at a time, and the bits where any differs from another */
    const v4l absmask = {0x7FFFFFFFFFFFFFFFLL, 0x7FFFFFFFFFFFFFFFLL, 0x7FFFFFFFFFFFFFFFLL, 0x7FFFFFFFFFFFFFFFLL};
    v4l any4 = {0}, all4 = {-1, -1, -1, -1};
    long n4 = n & ~3L;
    for (long i = 0; i < n4; i += 4) {
        v4l kv = (v4l)load(d + i) & absmask;
        memcpy(keys + i, &kv, sizeof kv);
        any4 |= kv;
        all4 &= kv;
    }
    uint64_t any = (uint64_t)(any4[0] | any4[1] | any4[2] | any4[3]);
    uint64_t all = (uint64_t)(all4[0] & all4[1] & all4[2] & all4[3]);
    for (long i = n4; i < n; i++) {
        keys[i] = key_of(d[i]);
        any |= keys[i];
        all &= keys[i];
    }
    if (nr > 0 && n > 0) {
        /* the first radix: the highest RADIX bits from the highest bit where the keys differ (above it
         * every key is the same), so that no pass finds every key in one bucket */
        uint64_t differ = any & ~all;
        int high = 63;
        while (high > 0 && !((differ >> high) & 1)) {
            high--;
        }
        select_keys(keys, n, r, nr, high >= RADIX - 1 ? high - (RADIX - 1) : 0, got, spare);
    }
    /* the values back in the requested order: r is the requested ranks and the edge, ascending */
    long w = 0, skip = -1;
    double edge = 0.0;
    for (long i = 0; k > 0 && i < nr; i++) {
        if (r[i] == n - k) {
            skip = i;
            edge = value_of(got[i]);
            break;
        }
    }
    for (long i = 0; i < nr; i++) {
        if (i != skip) {
            vals[w++] = value_of(got[i]);
        }
    }
    /* the top's d^2 / 2 (the k - above tokens at the edge's |d| added last) and the extreme
     * count, four lanes at a time */
    const v4d edge4 = {edge, edge, edge, edge}, ext4 = {extreme, extreme, extreme, extreme};
    v4d s4 = {0};
    v4l above4 = {0}, ext_n4 = {0};
    for (long i = 0; i < n4; i += 4) {
        v4d a = and_(load(d + i), absmask);
        v4l over = a > edge4;
        s4 += and_(0.5 * a * a, over);
        above4 -= over;
        ext_n4 -= a > ext4;
    }
    double s = lanes(s4);
    long above = lanes_l(above4), n_ext = lanes_l(ext_n4);
    for (long i = n4; i < n; i++) {
        double a = fabs(d[i]);
        n_ext += a > extreme;
        if (a > edge) {
            s += 0.5 * a * a;
            above++;
        }
    }
    if (k > 0) {
        s += (double)(k - above) * (0.5 * edge * edge);
    }
    top[0] = k > 0 ? s : 0.0;
    top[1] = (double)n_ext;
    return 0;
}

/* The tokens of d[0, n) with |d| above `level`: out = {count, sum d, sum y, sum |d|, and the
 * centred sums of products dd, dy, yy about their own means}: two passes, four lanes, each token
 * masked by its being above (no branch: about a third of the picks are not). */
__attribute__((target_clones("avx2", "default")))
void rldiag_mismatch_above(const double *d, const double *y, long n, double level, double *out) {
    const v4l absmask = {0x7FFFFFFFFFFFFFFFLL, 0x7FFFFFFFFFFFFFFFLL, 0x7FFFFFFFFFFFFFFFLL, 0x7FFFFFFFFFFFFFFFLL};
    const v4d lv = {level, level, level, level};
    v4d sd = {0}, sy = {0}, sa = {0};
    v4l c4 = {0};
    long n4 = n & ~3L;
    for (long i = 0; i < n4; i += 4) {
        v4d dv = load(d + i), yv = load(y + i), a = and_(dv, absmask);
        v4l w = a > lv;
        c4 -= w;
        sd += and_(dv, w);
        sy += and_(yv, w);
        sa += and_(a, w);
    }
    long c = lanes_l(c4);
    double s_d = lanes(sd), s_y = lanes(sy), s_a = lanes(sa);
    for (long i = n4; i < n; i++) {
        double a = fabs(d[i]);
        if (a > level) {
            c++;
            s_d += d[i];
            s_y += y[i];
            s_a += a;
        }
    }
    double md = c ? s_d / (double)c : 0.0, my = c ? s_y / (double)c : 0.0;
    const v4d mdv = {md, md, md, md}, myv = {my, my, my, my};
    v4d dd = {0}, dy = {0}, yy = {0};
    for (long i = 0; i < n4; i += 4) {
        v4d dv = load(d + i), yv = load(y + i);
        v4l w = and_(dv, absmask) > lv;
        v4d u = and_(dv - mdv, w), v = and_(yv - myv, w);
        dd += u * u;
        dy += u * v;
        yy += v * v;
    }
    double m_dd = lanes(dd), m_dy = lanes(dy), m_yy = lanes(yy);
    for (long i = n4; i < n; i++) {
        if (fabs(d[i]) > level) {
            double u = d[i] - md, v = y[i] - my;
            m_dd += u * u;
            m_dy += u * v;
            m_yy += v * v;
        }
    }
    out[0] = (double)c;
    out[1] = s_d;
    out[2] = s_y;
    out[3] = s_a;
    out[4] = m_dd;
    out[5] = m_dy;
    out[6] = m_yy;
}

/* The first threshold's sample of a chunk of m tokens (x, y and the mask as rldiag_mismatch_chunk
 * reads them): runs of `run` consecutive tokens, one starting every `step` tokens; out: each
 * sampled token's |x - y| in float64, 0 off the actor tokens, in order. Returns how many. */
__attribute__((target_clones("avx2", "default")))
long rldiag_mismatch_sample(const float *x, const float *y, const uint8_t *flags, const float *fmask, long m,
                            long step, long run, double *out) {
    long w = 0;
    for (long t0 = 0; t0 < m; t0 += step) {
        long end = t0 + run < m ? t0 + run : m;
        for (long t = t0; t < end; t++) {
            int masked = flags != NULL ? flags[t] != 0 : fmask != NULL ? fmask[t] > 0.0f : 1;
            double xv = (double)x[t], yv = (double)y[t];
            out[w++] = masked && isfinite(xv) && isfinite(yv) ? fabs(xv - yv) : 0.0;
        }
    }
    return w;
}
