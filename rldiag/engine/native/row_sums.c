/* The rows' sums of a token column after its chunk sums (rldiag.engine.layout.Rows.sum, whose
 * torch twin is Rows._chunked_sum): given the float32 sums of the tokens' whole chunks of PIECE
 * (torch's own, taken by the caller), the chunk sums' running total in float64, each row's whole
 * chunks as a difference of two running totals, its edge tokens (those of the chunks it shares
 * with its neighbours) summed one by one in float64, the two added, and the float64 sum rounded
 * to float32.
 *
 * The same float64 operations in the same order as the twin's torch ones (torch.cumsum's
 * sequential running sum from 0, index_select and a difference, segment_reduce's sequential
 * sum from 0 over the row's edge tokens in position order, a sum, a rounding), so the same bits
 * (tests/engine/test_rows_native.py), in one call where the twin makes nine torch operations of a
 * few microseconds each. A row whose sum is not finite is counted: the caller then sums every
 * row in float64 (a NaN or inf kept in its own row).
 *
 * Plain C loaded through ctypes (rldiag/engine/rows_native.py), built like mismatch_chunk.c:
 * IEEE arithmetic in the source's order, no contraction.
 */
#include <math.h>
#include <stdint.h>

int rldiag_rows_abi(void) { return 2; }

int rldiag_rows_fields(void) { return 1; }

/* The float64 sum of x[a, b) one by one from 0 (segment_reduce's order). */
static double run_sum(const float *x, int64_t a, int64_t b, double acc) {
    for (int64_t t = a; t < b; t++)
        acc = acc + (double)x[t];
    return acc;
}

/* x: (n,) float32 tokens; chunk: (nc,) float32 the sums of x's whole chunks [c piece, (c + 1)
 * piece) (nc = n / piece); off: (rows + 1,) int64 row offsets (0 <= off[r] <= off[r + 1] <= n);
 * before: (nc + 1,) float64 scratch (the running totals); out: (rows,) float32 each row's sum.
 * Returns how many rows' sums are not finite. */
long rldiag_rows_finish(const float *x, const float *chunk, long nc, long piece, const int64_t *off, long rows,
                        double *before, float *out) {
    double acc = 0.0;
    before[0] = 0.0;
    for (long c = 0; c < nc; c++) {
        acc = acc + (double)chunk[c];
        before[c + 1] = acc;
    }
    long bad = 0;
    for (long r = 0; r < rows; r++) {
        int64_t start = off[r], end = off[r + 1];
        int64_t lo = (start + piece - 1) / piece, hi = end / piece;
        if (lo > nc)
            lo = nc;
        double edges;
        if (hi > lo) { /* the head before the first whole chunk, then the tail after the last */
            edges = run_sum(x, hi * piece, end, run_sum(x, start, lo * piece, 0.0));
        } else {
            hi = lo;
            edges = run_sum(x, start, end, 0.0);
        }
        double s = (before[hi] - before[lo]) + edges;
        out[r] = (float)s;
        bad += !isfinite(s);
    }
    return bad;
}
