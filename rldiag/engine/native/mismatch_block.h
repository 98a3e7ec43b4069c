/* One block of rldiag_mismatch_chunk (mismatch_chunk.c): the series of its tokens, their
 * adjacent pairs and every sum, written once for eight float64 lanes held as G = 8 / W groups of
 * W lanes: W = 8 (one AVX-512 vector, G = 1) where the processor has AVX-512, W = 4 (AVX2's
 * 256 bits or SSE2's pairs, G = 2) elsewhere. Lane l of group g holds the tokens j + g W + l of
 * each octet j, and a sum's lanes are added in one order in both (lanes8d's), so both widths give
 * the same bits.
 *
 * Masks are made by integer arithmetic (negative8-style sign shifts), not comparisons, where they
 * are combined with other masks: GCC 12 makes scalar code of AVX-512 comparisons combined so.
 *
 * Two loops over the block at eight lanes (the series with their plain sums; then the pairs, the
 * levels and exp|d| from the series written), five at four, where AVX2's 16 registers hold fewer
 * accumulators: each accumulator adds the same terms in the same order either way. (One loop for
 * everything spills at eight lanes and takes longer.)
 *
 * Included by mismatch_chunk.c with W, BLOCK_FN and BLOCK_ATTR defined, after Block. */

#if W == 8
#define VD v8d
#define VL v8l
#define VU v8u
#define VF v8f
#define VI v8i
#define VIU v8iu
#define VRED lanes8d
#define VRED_L lanes8l
#define VEXP vexp8d
#define VEXP_SMALL vexp8d_small
#define VNEG negative8
#define VANY any8
#define VLOAD load8d
#define VLOAD_L load8l
#define FLAG_WORD uint64_t
#define FLAG_SHIFTS (v8u){0, 8, 16, 24, 32, 40, 48, 56}
#elif W == 4
#define VD v4d
#define VL v4l
#define VU v4u
#define VF v4f
#define VI v4i
#define VIU v4iu
#define VRED lanes
#define VRED_L lanes_l
#define VEXP vexp
#define VEXP_SMALL vexp4d_small
#define VNEG negative4
#define VANY any4
#define VLOAD load
#define VLOAD_L load_l
#define FLAG_WORD uint32_t
#define FLAG_SHIFTS (v4u){0, 8, 16, 24}
#else
#error "W is 8 or 4"
#endif
#define G (8 / W)

/* each group g's octets, its W lanes at tokens o .. o + W - 1: one group after the other, so that
 * a loop's accumulators of one group stay in registers */
#define EACH_OCTET(g, o)              \
    for (int g = 0; g < G; g++)       \
        for (long o = g * W; o < k; o += 8)

/* masks (-1 or 0 in each lane) of comparisons that pass 1 combines with others: comparisons at
 * four lanes (AVX2 has them); integer arithmetic at eight, where GCC 12 makes scalar code of
 * AVX-512 comparisons combined so. The same masks either way. */
#if W == 8
/* x finite: |x|'s bits below infinity's */
#define FINITE(x) VNEG(((VL)(x) & absmask) - 0x7FF0000000000000LL)
/* a > b for a, b >= 0: their bits are in the same order */
#define GREATER_NONNEG(a, b) VNEG((VL)(b) - (VL)(a))
/* a float32 mask above 0 (NaN not): bits - 1 in [0, +inf's bits) */
#define ABOVE_ZERO_F(f) -__builtin_convertvector(((((VIU)(f) - 1) - 0x7F800000u) >> 31) & ~(((VIU)(f) - 1) >> 31), VL)
/* non-zero where a float32's low 13 bits are 0 */
#define LOW_BITS_ZERO(u) ((((u) & 0x1FFF) - 1) >> 31)
#else
#define FINITE(x) ((VD)((VL)(x) & absmask) < zero + INFINITY)
#define GREATER_NONNEG(a, b) ((a) > (b))
#define ABOVE_ZERO_F(f) __builtin_convertvector((f) > (VF){0}, VL)
#define LOW_BITS_ZERO(u) (VIU)(((u) & 0x1FFF) == 0)
#endif

/* levels: confident, unconfident, extreme; total: the chunk's N_SUMS sums (this block's added,
 * a sum's lanes first); counts: n, n_conf, n_unconf, n_extreme, n_pairs (added). At eight lanes,
 * the tokens whose |d| is at least `least` picked: their d and y written to pick_d and pick_y from
 * *kept on, in order, and *kept advanced (at four, the caller picks). Returns whether a rollout
 * value might be a 16-bit float (a float32 whose low 13 bits are 0). */
BLOCK_ATTR int BLOCK_FN(Block *b, const float *bx, const float *by, const uint8_t *bf, const float *bm,
                               long k, long len, const double *levels, double *total, long long *counts,
                               double least, double *pick_d, double *pick_y, long *kept) {
    const VL absmask = (VL){0} + 0x7FFFFFFFFFFFFFFFLL;
#if W == 8
    const __m512d lv = _mm512_set1_pd(least);
    long picks = *kept;
#else
    (void)least, (void)pick_d, (void)pick_y, (void)kept;
#endif
    const VD zero = {0};
    /* each token's terms of the sums (d, y, |d|, p: 0 off the actor tokens; act its lane mask):
     * added where the series are made at eight lanes (AVX-512's 32 registers hold every
     * accumulator), in loops of a few sums over the block's series at four (AVX2 has 16) */
#define PLAIN_TERMS(g, d, yv, a, p)                                                   \
    do {                                                                              \
        VD ya_ = (VD)((VL)(yv) & absmask); /* |y| (0 off the actor tokens) */          \
        sd[g] += (d);                                                                  \
        sy[g] += (yv);                                                                 \
        sa[g] += (a);                                                                  \
        mdd[g] += (d) * (d);                                                           \
        mdy[g] += (d) * (yv);                                                          \
        myy[g] += (yv) * (yv);                                                         \
        s_p[g] += (p);                                                                 \
        map[g] += (a) * (p);                                                           \
        mpp[g] += (p) * (p);                                                           \
        sya[g] += ya_;                                                                 \
        maya[g] += (a) * ya_;                                                          \
    } while (0)
    /* levels of y (lanes of -1 where true, else 0), and exp|d| on the actor tokens: a lane's by
     * VEXP_SMALL up to SMALL_EXP, else by VEXP (each token's value depends on its own |d| only;
     * past VEXP's range the block is summed again below, by libm's exp) */
#define LEVEL_TERMS(g, d, yv, a)                                                      \
    do {                                                                              \
        VL c_ = (yv) >= conf, u_ = (yv) < unconf;                                      \
        dc[g] += (VD)((VL)(d) & c_);                                                   \
        du[g] += (VD)((VL)(d) & u_);                                                   \
        nc[g] -= c_;                                                                   \
        nu[g] -= u_;                                                                   \
        ne[g] -= (a) > ext;                                                            \
    } while (0)
#define EXP_TERMS(g, a, act)                                                          \
    do {                                                                              \
        VD e_ = VEXP_SMALL(a);                                                         \
        VL big_ = (a) > small;                                                         \
        if (VANY(big_)) {                                                              \
            e_ = (VD)(((VL)VEXP(a) & big_) | ((VL)e_ & ~big_));                        \
        }                                                                              \
        se[g] += (VD)((VL)e_ & (act));                                                 \
    } while (0)
    /* the pairs (t - 1, t): both actor tokens, t not a row's first */
#define PAIR_TERMS(g, o)                                                                                          \
    do {                                                                                                          \
        VL pair = VLOAD_L(b->act + o) & VLOAD_L(b->act + o + 1) & ~VLOAD_L(b->rs + o + 1);                         \
        VD xp = VLOAD(b->px + o), x1 = VLOAD(b->px + o + 1), yp = VLOAD(b->py + o), y1 = VLOAD(b->py + o + 1);     \
        pa[g] += (VD)((VL)(VLOAD(b->pa + o) + VLOAD(b->pa + o + 1)) & pair);                                     \
        sn[g] += (VD)((VL)(yp - x1) & absmask & pair);                                                            \
        sp[g] += (VD)((VL)(y1 - xp) & absmask & pair);                                                            \
        np[g] -= pair;                                                                                            \
    } while (0)
    VD pa[G] = {{0}}, sn[G] = {{0}}, sp[G] = {{0}};
    VL np[G] = {{0}};
    const VD conf = zero + levels[0], unconf = zero + levels[1], ext = zero + levels[2], small = zero + SMALL_EXP;
    VD sd[G] = {{0}}, sy[G] = {{0}}, sa[G] = {{0}}, mdd[G] = {{0}}, mdy[G] = {{0}}, myy[G] = {{0}};
    VD s_p[G] = {{0}}, map[G] = {{0}}, mpp[G] = {{0}}, sya[G] = {{0}}, maya[G] = {{0}};
    VD dc[G] = {{0}}, du[G] = {{0}}, se[G] = {{0}};
    VL nc[G] = {{0}}, nu[G] = {{0}}, ne[G] = {{0}};
    /* the series, 0 off the actor tokens */
    VL nv[G] = {{0}};
    VD amax[G] = {{0}};
    VIU low[G] = {{0}}; /* not 0 in a lane where a value's float32 has its low 13 bits 0 */
    EACH_OCTET(g, o) {
        VF xf, yf;
        memcpy(&xf, bx + o, sizeof xf);
        memcpy(&yf, by + o, sizeof yf);
        VD xv = __builtin_convertvector(xf, VD), yv = __builtin_convertvector(yf, VD);
        low[g] |= LOW_BITS_ZERO((VIU)yf);
        VL fm = (VL){0} - 1;
        if (bf != NULL) { /* the bytes, each moved to its lane: -1 where it is not 0 */
            FLAG_WORD f;
            memcpy(&f, bf + o, sizeof f);
            VU byte = (((VU){0} + f) >> FLAG_SHIFTS) & 0xFF;
            fm = -(VL)((byte + 0xFF) >> 8);
        } else if (bm != NULL) {
            VF f;
            memcpy(&f, bm + o, sizeof f);
            fm = ABOVE_ZERO_F(f);
        }
        VL act = fm & FINITE(xv) & FINITE(yv);
        VD d = (VD)((VL)(xv - yv) & act);
        VD ym = (VD)((VL)yv & act);
        VD a = (VD)((VL)d & absmask);
        VD p = (VD)((VL)VLOAD(b->p + o) & act);
        memcpy(b->d + o, &d, sizeof d);
        memcpy(b->y + o, &ym, sizeof ym);
        memcpy(b->a + o, &a, sizeof a);
        memcpy(b->p + o, &p, sizeof p);
        memcpy(b->px + o + 1, &xv, sizeof xv);
        memcpy(b->py + o + 1, &yv, sizeof yv);
        memcpy(b->pa + o + 1, &a, sizeof a);
        memcpy(b->act + o + 1, &act, sizeof act);
        nv[g] -= act;
        VL more = GREATER_NONNEG(a, amax[g]);
        amax[g] = (VD)(((VL)a & more) | ((VL)amax[g] & ~more));
#if W == 8 /* the plain sums here: AVX-512's 32 registers hold their accumulators */
        PLAIN_TERMS(g, d, ym, a, p);
        /* the picked tokens (|d| at least `least`: never the padding, whose |d| is 0), moved to
         * the front by AVX-512's compression, all eight places written (the kept first) */
        __mmask8 keep = _mm512_cmp_pd_mask((__m512d)a, lv, _CMP_GE_OQ);
        _mm512_storeu_pd(pick_d + picks, _mm512_maskz_compress_pd(keep, (__m512d)d));
        _mm512_storeu_pd(pick_y + picks, _mm512_maskz_compress_pd(keep, (__m512d)ym));
        picks += __builtin_popcount((unsigned)keep);
#endif
    }
#if W == 8
    *kept = picks;
#endif
#if W == 4 /* AVX2's 16 registers: the plain sums in a loop of their own */
    EACH_OCTET(g, o) {
        VD d = VLOAD(b->d + o), yv = VLOAD(b->y + o), a = VLOAD(b->a + o), p = VLOAD(b->p + o);
        PLAIN_TERMS(g, d, yv, a, p);
    }
#endif
    EACH_OCTET(g, o) {
        VD d = VLOAD(b->d + o), yv = VLOAD(b->y + o), a = VLOAD(b->a + o);
        LEVEL_TERMS(g, d, yv, a);
#if W == 8
        PAIR_TERMS(g, o);
#endif
#if W == 4 /* AVX2's 16 registers: exp|d| in a loop of its own */
    }
    EACH_OCTET(g, o) {
        VD a = VLOAD(b->a + o);
#endif
        EXP_TERMS(g, a, VLOAD_L(b->act + o + 1));
    }
#undef PLAIN_TERMS
#undef LEVEL_TERMS
#undef EXP_TERMS
    double block_max = 0.0;
    int half_any = 0;
    for (int g = 0; g < G; g++) {
        counts[0] += VRED_L(nv[g]);
        for (int l = 0; l < W; l++) {
            block_max = amax[g][l] > block_max ? amax[g][l] : block_max;
            half_any |= low[g][l] != 0;
        }
    }
    if (block_max > 700.0) { /* some |d| above vexp's range (a probability ratio past e^700) */
        for (int g = 0; g < G; g++) {
            se[g] = zero;
        }
        for (long j = 0; j < len; j++) {
            se[0][0] += b->act[j + 1] ? exp(b->a[j]) : 0.0;
        }
    }
#if W == 4
    EACH_OCTET(g, o) {
        PAIR_TERMS(g, o);
    }
#endif
#undef PAIR_TERMS
    /* each sum's groups in lanes8d's order: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) */
#if G == 1
#define ADD(slot, v) total[slot] += VRED(v[0])
#define ADD_L(slot, v) counts[slot] += VRED_L(v[0])
#else
#define ADD(slot, v) total[slot] += VRED(v[0]) + VRED(v[1])
#define ADD_L(slot, v) counts[slot] += VRED_L(v[0]) + VRED_L(v[1])
#endif
    ADD(S_PA, pa);
    ADD(S_SN, sn);
    ADD(S_SP, sp);
    ADD(S_D, sd);
    ADD(S_Y, sy);
    ADD(S_A, sa);
    ADD(S_DD, mdd);
    ADD(S_DY, mdy);
    ADD(S_YY, myy);
    ADD(S_P, s_p);
    ADD(S_AP, map);
    ADD(S_PP, mpp);
    ADD(S_YA, sya);
    ADD(S_AYA, maya);
    ADD(S_DC, dc);
    ADD(S_DU, du);
    ADD(S_EXP, se);
    ADD_L(1, nc);
    ADD_L(2, nu);
    ADD_L(3, ne);
    ADD_L(4, np);
#undef ADD
#undef ADD_L
    return half_any;
}

#undef VD
#undef VL
#undef VU
#undef VF
#undef VI
#undef VIU
#undef VRED
#undef VRED_L
#undef VEXP
#undef VEXP_SMALL
#undef VNEG
#undef VANY
#undef VLOAD
#undef VLOAD_L
#undef EACH_OCTET
#undef FLAG_WORD
#undef FLAG_SHIFTS
#undef FINITE
#undef GREATER_NONNEG
#undef ABOVE_ZERO_F
#undef LOW_BITS_ZERO
#undef G
