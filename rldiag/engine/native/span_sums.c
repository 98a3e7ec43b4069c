/* Masked sums of several token columns over each span of a layout in one read (the turns
 * stage's spans: rldiag/engine/stages/turns.py, whose twin makes two passes a column, and one
 * more for a difference of two columns, rldiag.engine.layout.Rows.masked_sum): per span, the
 * mask's own sum (Rows.mask_count) and, for each column v, the sum of v m over the tokens whose
 * mask m is not 0 (a NaN or an infinity off the mask goes nowhere, as verl's masked_sum), and
 * the same for the float32 difference a - b of two more columns where given.
 *
 * Each term is float32 (the twin's product), summed in eight float32 lanes over blocks of BLOCK
 * tokens, the blocks added in float64: within float32's rounding of the twin's sums (float32
 * chunks added in float64). Plain C loaded through ctypes (rldiag/engine/span_native.py), built
 * like mismatch_chunk.c: IEEE arithmetic in the source's order, no contraction.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"

#define BLOCK 256
#define MAX_SERIES 8

int rldiag_spans_abi(void) { return 1; }

int rldiag_spans_fields(void) { return MAX_SERIES; }

INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* eight tokens into the series' block sums: from i of the columns, or from `pad` (the mask, the
 * columns and the difference's two, eight lanes each) where `padded` */
INLINE void add8(const float *const *cols, long k, const float *da, const float *db, v8f m, v8f *acc, const float *pad,
                 long i, int padded) {
    v8i on = m != splat8(0.0f);
    acc[0] += m;
    for (long j = 0; j < k; j++) {
        v8f v = padded ? load8(pad + 8 * (j + 1)) : load8(cols[j] + i);
        acc[1 + j] += select8(on, v * m, splat8(0.0f));
    }
    if (da != NULL) {
        v8f d = padded ? load8(pad + 8 * (k + 1)) - load8(pad + 8 * (k + 2)) : load8(da + i) - load8(db + i);
        acc[1 + k] += select8(on, d * m, splat8(0.0f));
    }
}

/* cols: k pointers to (tokens,) float32 columns (k + 2 <= MAX_SERIES); da, db: two more columns
 * whose difference is summed (or NULL); fmask: the float32 mask, else bmask its bytes, else
 * neither (every token counts with weight 1: plain sums); offsets:
 * (n + 1,). Out: (n, 1 + k + (da != NULL)) float64: per span the mask's sum, each column's
 * masked sum and the difference's. Returns 0, or -1 for too many columns. */
__attribute__((target_clones("avx2", "default")))
long rldiag_span_sums(const float *const *cols, long k, const float *da, const float *db, const float *fmask,
                      const uint8_t *bmask, const int64_t *offsets, long n, double *out) {
    long width = 1 + k + (da != NULL);
    if (k < 0 || width > MAX_SERIES) {
        return -1;
    }
    float pad[8 * (MAX_SERIES + 2)];
    for (long s = 0; s < n; s++) {
        double tot[MAX_SERIES] = {0};
        long end = offsets[s + 1];
        for (long b0 = offsets[s]; b0 < end; b0 += BLOCK) {
            long stop = end - b0 < BLOCK ? end : b0 + BLOCK;
            v8f acc[MAX_SERIES];
            for (long j = 0; j < width; j++) {
                acc[j] = splat8(0.0f);
            }
            long i = b0;
            for (; i + 8 <= stop; i += 8) {
                add8(cols, k, da, db, mask8(fmask, bmask, i), acc, NULL, i, 0);
            }
            if (i < stop) { /* the block's last tokens, padded off the mask */
                memset(pad, 0, sizeof pad);
                for (long t = 0; t < stop - i; t++) {
                    pad[t] = fmask != NULL ? fmask[i + t] : bmask != NULL ? (float)bmask[i + t] : 1.0f;
                    for (long j = 0; j < k; j++) {
                        pad[8 * (j + 1) + t] = cols[j][i + t];
                    }
                    if (da != NULL) {
                        pad[8 * (k + 1) + t] = da[i + t];
                        pad[8 * (k + 2) + t] = db[i + t];
                    }
                }
                add8(cols, k, da, db, load8(pad), acc, pad, i, 1);
            }
            for (long j = 0; j < width; j++) {
                v8f v = acc[j];
                tot[j] += (((double)v[0] + v[1]) + ((double)v[2] + v[3])) + (((double)v[4] + v[5]) + ((double)v[6] + v[7]));
            }
        }
        for (long j = 0; j < width; j++) {
            out[s * width + j] = tot[j];
        }
    }
    return 0;
}
