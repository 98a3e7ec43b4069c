"""Straightforward per-row reference implementations (Python loops, floats) of verl's policy
losses, loss aggregation and rollout correction, written from verl's core_algos /
rollout_corr_helper semantics for ONE batch (one step or one micro-batch), to check the
vectorised engine against. Rows are lists of per-token values of the row's length."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EPS = 1e-8


def clamp(x, lo=None, hi=None):
    if lo is not None and x < lo:
        x = lo
    if hi is not None and x > hi:
        x = hi
    return x


def masked_mean(values, mask):
    s = sum(v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m)
    n = sum(m for mrow in mask for m in mrow)
    return s / (n + EPS)


def row_mean(row, mrow):
    return sum(v for v, m in zip(row, mrow) if m) / (sum(mrow) + EPS)


def std_bessel(xs):
    if len(xs) <= 1:
        return 0.0
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


@dataclass
class Norm:
    """Global normalisers of the batch (verl's global_batch_info); None = verl's fallback."""

    batch_num_tokens: float | None = None
    global_batch_size: float | None = None
    loss_scale_factor: float | None = None
    horizon: int = 1


def _div(a, b):
    """``a / b`` as float32 torch divides: 0/0 is NaN (an empty micro-batch)."""
    if b == 0:
        return math.nan if a == 0 else math.copysign(math.inf, a)
    return a / b


def agg_ref(loss, mask, mode, norm: Norm):
    """verl's agg_loss with dp_size 1."""
    row_sums = [sum(x for x, m in zip(lr, mr) if m) for lr, mr in zip(loss, mask)]
    counts = [sum(mr) for mr in mask]
    if mode == "token-mean":
        n = norm.batch_num_tokens if norm.batch_num_tokens is not None else sum(counts)
        return _div(sum(row_sums), n)
    if mode == "token-sum":
        return sum(row_sums)
    b = norm.global_batch_size if norm.global_batch_size is not None else sum(1 for c in counts if c > 0)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        out = _div(sum(s for s, c in zip(row_sums, counts) if c > 0), b)
        if mode == "seq-mean-token-sum-norm":
            out /= norm.loss_scale_factor if norm.loss_scale_factor is not None else norm.horizon
        return out
    if mode == "seq-mean-token-mean":
        return _div(sum(s / (c + 1e-8) for s, c in zip(row_sums, counts) if c > 0), b)
    raise ValueError(mode)


@dataclass
class Cfg:
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float = 0.1
    agg: str = "token-mean"
    norm: Norm = field(default_factory=Norm)


def _tok(old, new, adv, mask, fn):
    return [[fn(o, n, a) for o, n, a in zip(orow, nrow, arow)] for orow, nrow, arow in zip(old, new, adv)]


def _apply_w(losses, w):
    if w is None:
        return losses
    return [[v * x for v, x in zip(lr, wr)] for lr, wr in zip(losses, w)]


def vanilla_ref(old, new, adv, mask, cfg: Cfg, w=None):
    losses, clip, lower, kl = [], [], [], []
    for orow, nrow, arow in zip(old, new, adv):
        lr, cr, lwr, kr = [], [], [], []
        for o, n, a in zip(orow, nrow, arow):
            nk = clamp(n - o, -20.0, 20.0)
            r = math.exp(nk)
            l1 = -a * r
            l2 = -a * clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high)
            c1 = max(l1, l2)
            l3 = -a * cfg.clip_c
            lr.append(min(l3, c1) if a < 0 else c1)
            cr.append(1.0 if l2 > l1 else 0.0)
            lwr.append(1.0 if (c1 > l3 and a < 0) else 0.0)
            kr.append(-nk)
        losses.append(lr)
        clip.append(cr)
        lower.append(lwr)
        kl.append(kr)
    losses = _apply_w(losses, w)
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), {
        "actor/pg_clipfrac": masked_mean(clip, mask),
        "actor/ppo_kl": masked_mean(kl, mask),
        "actor/pg_clipfrac_lower": masked_mean(lower, mask),
    }


def up_ref(old, new, adv, mask, cfg: Cfg, w=None):
    v_losses, _, met = vanilla_ref(old, new, adv, mask, cfg)
    losses = [[-a if a > 0 else vl for a, vl in zip(ar, vr)] for ar, vr in zip(adv, v_losses)]
    losses = _apply_w(losses, w)
    clip = _tok(old, new, adv, mask, lambda o, n, a: 1.0 if (
        -a * clamp(math.exp(clamp(n - o, -20, 20)), 1 - cfg.clip_low, 1 + cfg.clip_high) > -a * math.exp(clamp(n - o, -20, 20))
    ) else 0.0)
    non_pos = [[m * (1.0 if a <= 0 else 0.0) for m, a in zip(mr, ar)] for mr, ar in zip(mask, adv)]
    met = dict(met)
    met["actor/pg_clipfrac"] = masked_mean(clip, non_pos)
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), met


def gspo_ref(old, new, adv, mask, cfg: Cfg, w=None):
    losses, clip = [], []
    for orow, nrow, arow, mrow in zip(old, new, adv, mask):
        L = max(sum(mrow), 1)
        s = math.exp(min(sum((n - o) * m for o, n, m in zip(orow, nrow, mrow)) / L, 10.0))
        lr, cr = [], []
        for a in arow:
            l1, l2 = -a * s, -a * clamp(s, 1 - cfg.clip_low, 1 + cfg.clip_high)
            lr.append(max(l1, l2))
            cr.append(1.0 if l2 > l1 else 0.0)
        losses.append(lr)
        clip.append(cr)
    losses = _apply_w(losses, w)
    kl = _tok(old, new, adv, mask, lambda o, n, a: o - n)
    return losses, agg_ref(losses, mask, "seq-mean-token-mean", cfg.norm), {
        "actor/pg_clipfrac": masked_mean(clip, mask), "actor/ppo_kl": masked_mean(kl, mask), "actor/pg_clipfrac_lower": 0.0,
    }


def sapo_ref(old, new, adv, mask, cfg: Cfg, w=None):
    def f(o, n, a):
        tau = cfg.tau_pos if a > 0 else cfg.tau_neg
        r = math.exp(clamp(n - o, -20, 20))
        return -(1 / (1 + math.exp(-tau * (r - 1))) * 4 / tau) * a

    losses = _apply_w(_tok(old, new, adv, mask, f), w)
    kl = _tok(old, new, adv, mask, lambda o, n, a: -clamp(n - o, -20, 20))
    return losses, agg_ref(losses, mask, "seq-mean-token-mean", cfg.norm), {
        "actor/pg_clipfrac": 0.0, "actor/ppo_kl": masked_mean(kl, mask), "actor/pg_clipfrac_lower": 0.0,
    }


def cispo_ref(old, new, adv, mask, cfg: Cfg, w=None):
    def f(o, n, a):
        r = math.exp(clamp(n - o, -20, 20))
        return -clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high) * a * n

    losses = _apply_w(_tok(old, new, adv, mask, f), w)
    clip = _tok(old, new, adv, mask, lambda o, n, a: 1.0 if not (
        1 - cfg.clip_low <= math.exp(clamp(n - o, -20, 20)) <= 1 + cfg.clip_high) else 0.0)
    kl = _tok(old, new, adv, mask, lambda o, n, a: -clamp(n - o, -20, 20))
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), {
        "actor/pg_clipfrac": masked_mean(clip, mask), "actor/ppo_kl": masked_mean(kl, mask), "actor/pg_clipfrac_lower": 0.0,
    }


def _dppo_ref(old, new, adv, mask, cfg, w, valid_fn):
    losses, invalid, lower = [], [], []
    for orow, nrow, arow in zip(old, new, adv):
        lr, ir, lwr = [], [], []
        for o, n, a in zip(orow, nrow, arow):
            r = math.exp(clamp(n - o, -20, 20))
            v = 1.0 if valid_fn(o, n, a) else 0.0
            lr.append(-a * min(r, cfg.clip_c) * n * v)
            ir.append(1.0 - v)
            lwr.append((1.0 if r > cfg.clip_c else 0.0) * v)
        losses.append(lr)
        invalid.append(ir)
        lower.append(lwr)
    losses = _apply_w(losses, w)
    kl = _tok(old, new, adv, mask, lambda o, n, a: -clamp(n - o, -20, 20))
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), {
        "actor/pg_clipfrac": masked_mean(invalid, mask), "actor/ppo_kl": masked_mean(kl, mask),
        "actor/pg_clipfrac_lower": masked_mean(lower, mask),
    }


def dppo_tv_ref(old, new, adv, mask, cfg: Cfg, w=None):
    def valid(o, n, a):
        d = math.exp(n) - math.exp(o)
        return d <= cfg.clip_high if a > 0 else d >= -cfg.clip_low

    return _dppo_ref(old, new, adv, mask, cfg, w, valid)


def dppo_kl_ref(old, new, adv, mask, cfg: Cfg, w=None):
    def valid(o, n, a):
        p, po = math.exp(n), math.exp(o)
        bkl = po * (o - n) + (1 - po) * math.log((1 - po + 1e-8) / (1 - p + 1e-8))
        if a > 0:
            return bkl <= cfg.clip_high or p <= po
        return bkl <= cfg.clip_low or p >= po

    return _dppo_ref(old, new, adv, mask, cfg, w, valid)


def geo_mean_ref(old, new, adv, mask, cfg: Cfg, w=None):
    row_losses, clip_hi, clip_lo = [], [], []
    for orow, nrow, arow, mrow, wrow in zip(old, new, adv, mask, w or [None] * len(old)):
        cnt = sum(mrow) + 1e-8
        acc, asum = 0.0, 0.0
        chr_, clr = [], []
        for o, n, a, m in zip(orow, nrow, arow, mrow):
            x = n - o
            xc = clamp(x, -cfg.clip_low, cfg.clip_high)
            sg = int(a > 0) - int(a < 0)
            acc += sg * min(sg * x, sg * xc) * m
            asum += a * m
            chr_.append(1.0 if (x != xc and a > 0) else 0.0)
            clr.append(1.0 if (x != xc and a < 0) else 0.0)
        loss = -(asum / cnt) * math.exp(acc / cnt)
        if wrow is not None:
            loss *= math.exp(sum(math.log(x + 1e-10) * m for x, m in zip(wrow, mrow)) / cnt)
        row_losses.append(loss)
        clip_hi.append(chr_)
        clip_lo.append(clr)
    kl = _tok(old, new, adv, mask, lambda o, n, a: o - n)
    losses = [[v * m for m in mrow] for v, mrow in zip(row_losses, mask)]
    return losses, sum(row_losses) / len(row_losses), {
        "actor/pg_clipfrac": masked_mean(clip_hi, mask), "actor/ppo_kl": masked_mean(kl, mask),
        "actor/pg_clipfrac_lower": masked_mean(clip_lo, mask),
    }


def gpg_ref(old, new, adv, mask, cfg: Cfg, w=None):
    losses = _apply_w(_tok(old, new, adv, mask, lambda o, n, a: -n * a), w)
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), {}


def dro_ref(old, new, adv, mask, cfg: Cfg, w=None):
    losses = _apply_w(_tok(old, new, adv, mask, lambda o, n, a: -(n * a - 0.5 * cfg.dro_beta * (n - o) ** 2)), w)
    kl = _tok(old, new, adv, mask, lambda o, n, a: o - n)
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), {"actor/ppo_kl": masked_mean(kl, mask)}


def clip_cov_ref(old, new, adv, mask, cfg: Cfg, w=None):
    """Expected loss over verl's random choice of ``k`` among the candidates."""
    ma = masked_mean(adv, mask)
    ml = masked_mean(new, mask)
    base, cand = [], []
    for orow, nrow, arow, mrow in zip(old, new, adv, mask):
        br, cr = [], []
        for o, n, a, m in zip(orow, nrow, arow, mrow):
            r = math.exp(n - o)
            l1, l2 = -a * r, -a * clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high)
            br.append(max(l1, l2))
            cov = (a - ma) * (n - ml)
            cr.append(bool(m) and not (l2 > l1) and cfg.clip_cov_lb < cov < cfg.clip_cov_ub)
        base.append(br)
        cand.append(cr)
    n_tok = sum(sum(mr) for mr in mask)
    k = max(int(cfg.clip_cov_ratio * n_tok), 1)
    n_cand = sum(sum(cr) for cr in cand)
    chosen = min(k, n_cand)
    p = chosen / n_cand if n_cand else 0.0
    losses = [[b * ((1 - p) if c else 1.0) for b, c in zip(br, cr)] for br, cr in zip(base, cand)]
    losses = _apply_w(losses, w)
    kl = _tok(old, new, adv, mask, lambda o, n, a: o - n)
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), {
        "actor/pg_clipfrac": chosen / (n_tok + 1e-8), "actor/ppo_kl": masked_mean(kl, mask),
    }


def kl_cov_ref(old, new, adv, mask, cfg: Cfg, w=None):
    toks = [(i, t) for i, mr in enumerate(mask) for t, m in enumerate(mr) if m]
    losses = [[-a * math.exp(n - o) for o, n, a in zip(orow, nrow, arow)] for orow, nrow, arow in zip(old, new, adv)]
    if toks:
        ma = sum(adv[i][t] for i, t in toks) / len(toks)
        ml = sum(new[i][t] for i, t in toks) / len(toks)
        covs = [((adv[i][t] - ma) * (new[i][t] - ml), -j) for j, (i, t) in enumerate(toks)]
        k = max(1, int(len(toks) * cfg.kl_cov_ratio))
        for _, negj in sorted(covs, reverse=True)[:k]:
            i, t = toks[-negj]
            losses[i][t] += cfg.ppo_kl_coef * abs(new[i][t] - old[i][t])
    losses = _apply_w(losses, w)
    kl = _tok(old, new, adv, mask, lambda o, n, a: abs(n - o))
    return losses, agg_ref(losses, mask, cfg.agg, cfg.norm), {"actor/ppo_kl": masked_mean(kl, mask)}


def kl_cov_cut_is_ambiguous(new, adv, mask, ratio, tol=1e-5):
    """True when kl_cov's top-k cut falls between (nearly) equal covariances: which token is picked
    is then float-rounding noise (in verl's float32 topk as well), not a property to test.
    E.g. a batch of exactly two tokens always ties (the two covariances are equal)."""
    toks = [(i, t) for i, mr in enumerate(mask) for t, m in enumerate(mr) if m]
    if len(toks) < 2:
        return False
    ma = sum(adv[i][t] for i, t in toks) / len(toks)
    ml = sum(new[i][t] for i, t in toks) / len(toks)
    covs = sorted(((adv[i][t] - ma) * (new[i][t] - ml) for i, t in toks), reverse=True)
    k = max(1, int(len(toks) * ratio))
    if k >= len(covs):
        return False
    return abs(covs[k - 1] - covs[k]) <= tol * max(1.0, abs(covs[k - 1]))


REFERENCES = {
    "vanilla": vanilla_ref,
    "up": up_ref,
    "gspo": gspo_ref,
    "sapo": sapo_ref,
    "cispo": cispo_ref,
    "dppo_tv": dppo_tv_ref,
    "dppo_kl": dppo_kl_ref,
    "geo_mean": geo_mean_ref,
    "gpg": gpg_ref,
    "dro": dro_ref,
    "clip_cov": clip_cov_ref,
    "kl_cov": kl_cov_ref,
}


# ---- rollout correction ------------------------------------------------------------------------


@dataclass
class RC:
    rollout_is: str | None = None
    upper: float = 2.0
    lower: float | None = None  # IcePop when set
    batch_normalize: bool = False
    rs: dict = field(default_factory=dict)  # option -> (lower|None, upper) in verl units


def _k(opt, lr):
    lr = clamp(lr, -20.0, 20.0)
    if opt.endswith("k1"):
        return -lr
    if opt.endswith("k2"):
        return 0.5 * lr * lr
    return math.exp(lr) - 1.0 - lr


def _bkl(lp, lq, eps=1e-6):
    p = clamp(math.exp(lp), eps, 1 - eps)
    q = clamp(math.exp(lq), eps, 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _std_two_pass(values, mask):
    """verl's sqrt(mm(x^2) - mm(x)^2) evaluated as sqrt(mm((x - mm x)^2)): rldiag's documented
    two-pass form (verl's one-pass float32 value is within ~sqrt(eps32) * rms of it)."""
    mu = masked_mean(values, mask)
    return math.sqrt(max(masked_mean([[(x - mu) ** 2 for x in r] for r in values], mask), 0.0))


def rollout_correction_ref(train, rollout, mask, cfg: RC):
    """(IS weights or None, new mask, metrics without the rollout_corr/ prefix) for one batch."""
    lr = [[a - b for a, b in zip(tr, rr)] for tr, rr in zip(train, rollout)]
    rows = len(mask)
    valid_rows = [i for i in range(rows) if sum(mask[i]) > 0]
    mtr = {}
    weights = None
    if cfg.rollout_is is not None:
        up, lo = cfg.upper, cfg.lower
        lo_m = 1 / up if lo is None else lo
        if cfg.rollout_is == "token":
            raw = [[math.exp(clamp(x, -20, 20)) * m for x, m in zip(r, mr)] for r, mr in zip(lr, mask)]
        else:
            sums = [sum(x * m for x, m in zip(r, mr)) for r, mr in zip(lr, mask)]
            raw = [[math.exp(clamp(s, -20, 20)) * m for m in mr] for s, mr in zip(sums, mask)]
        if lo is None:
            wts = [[min(x, up) for x in r] for r in raw]
        else:
            wts = [[x if lo <= x <= up else 0.0 for x in r] for r in raw]
        vals = [w for r, mr in zip(wts, mask) for w, m in zip(r, mr) if m]
        mtr["rollout_is_mean"] = masked_mean(wts, mask)
        if cfg.rollout_is == "sequence":
            mtr["rollout_is_max"] = math.exp(min(max(sums), 20.0))
            mtr["rollout_is_min"] = math.exp(min(sums))
            mtr["rollout_is_ratio_fraction_high"] = sum(s > math.log(up) for s in sums) / rows
            mtr["rollout_is_ratio_fraction_low"] = sum(s < math.log(lo_m) for s in sums) / rows
        else:
            mtr["rollout_is_max"], mtr["rollout_is_min"] = max(vals), min(vals)
            mtr["rollout_is_ratio_fraction_high"] = masked_mean([[1.0 if x > up else 0.0 for x in r] for r in raw], mask)
            mtr["rollout_is_ratio_fraction_low"] = masked_mean([[1.0 if x < lo_m else 0.0 for x in r] for r in raw], mask)
        cl = [[clamp(x, 0.0, up) for x in r] for r in wts]
        mtr["rollout_is_std"] = _std_two_pass(cl, mask) if len(vals) > 1 else 0.0
        mu = masked_mean(cl, mask)
        mtr["rollout_is_eff_sample_size"] = 1.0 / masked_mean([[(x / (mu + 1e-8)) ** 2 for x in r] for r in cl], mask)
        seqw = [row_mean(r, mr) for r, mr in zip(wts, mask)]
        mtr["rollout_is_seq_mean"] = sum(seqw) / rows
        mtr["rollout_is_seq_std"] = std_bessel(seqw)
        mtr["rollout_is_seq_max"], mtr["rollout_is_seq_min"] = max(seqw), min(seqw)
        mtr["rollout_is_seq_max_deviation"] = max(abs(x - 1) for x in seqw)
        rawseq = [row_mean(r, mr) for r, mr in zip(raw, mask)]
        mtr["rollout_is_seq_fraction_high"] = sum(x > up for x in rawseq) / rows
        mtr["rollout_is_seq_fraction_low"] = sum(x < lo_m for x in rawseq) / rows
        if lo is not None:
            mtr["rollout_is_oob_ratio"] = masked_mean([[1.0 if (x < lo or x > up) else 0.0 for x in r] for r in raw], mask)
        if cfg.batch_normalize:
            if cfg.rollout_is == "token":
                mean_w = masked_mean(wts, mask)
            else:
                mean_w = sum(seqw[i] for i in valid_rows) / max(len(valid_rows), 1e-8)
            if mean_w > 1e-8:
                wts = [[x / mean_w for x in r] for r in wts]
                mtr["rollout_is_batch_norm_factor"] = mean_w
            else:
                mtr["rollout_is_batch_norm_factor"] = 1.0
        weights = wts
    combined = [[1.0] * len(mr) for mr in mask]
    for opt, (lower, upper) in cfg.rs.items():
        is_k1 = opt.endswith("k1")
        hi = math.log(upper) if is_k1 else upper
        lo = math.log(lower) if is_k1 else 0.0
        if opt == "binary_kl":
            tok = [[max(_bkl(t, r), _bkl(r, t)) for t, r in zip(tr, rr)] for tr, rr in zip(train, rollout)]
        else:
            tok = [[_k(opt, x) for x in r] for r in lr]
        seq_level = opt.startswith("seq_")
        if seq_level:
            rowstat = []
            for r, mr in zip(tok, mask):
                sel = [x for x, m in zip(r, mr) if m]
                if opt.startswith("seq_sum"):
                    rowstat.append(sum(sel))
                elif opt.startswith("seq_mean"):
                    rowstat.append(sum(sel) / (len(sel) + 1e-8))
                else:
                    rowstat.append(max(sel) if sel else 0.0)
            stat = [[s] * len(mr) for s, mr in zip(rowstat, mask)]
            keep = [[(lo <= s <= hi) if is_k1 else s <= hi for _ in mr] for s, mr in zip(rowstat, mask)]
            seqv = rowstat
        else:
            stat = tok
            keep = [[(lo <= x <= hi) if is_k1 else x <= hi for x in r] for r in tok]
            seqv = [row_mean(r, mr) for r, mr in zip(tok, mask)]
        p = f"rollout_rs_{opt}"
        sv = [seqv[i] for i in valid_rows]
        mtr[f"{p}_mean"] = masked_mean(stat, mask)
        if seq_level:
            mtr[f"{p}_max"], mtr[f"{p}_min"] = max(sv), min(sv)
            mtr[f"{p}_fraction_high"] = sum(x > hi for x in sv) / len(sv)
            mtr[f"{p}_fraction_low"] = sum(x < lo for x in sv) / len(sv) if is_k1 else 0.0
        else:
            tv = [x for r, mr in zip(stat, mask) for x, m in zip(r, mr) if m]
            mtr[f"{p}_max"], mtr[f"{p}_min"] = max(tv), min(tv)
            mtr[f"{p}_fraction_high"] = masked_mean([[1.0 if x > hi else 0.0 for x in r] for r in stat], mask)
            mtr[f"{p}_fraction_low"] = (
                masked_mean([[1.0 if x < lo else 0.0 for x in r] for r in stat], mask) if is_k1 else 0.0
            )
        n_tok = sum(sum(mr) for mr in mask)
        if n_tok > 1:
            cl = [[min(max(x, lo), hi) if lo <= hi else hi for x in r] for r in stat]
            mtr[f"{p}_std"] = _std_two_pass(cl, mask)
        else:
            mtr[f"{p}_std"] = 0.0
        mtr[f"{p}_seq_mean"] = sum(sv) / len(sv)
        mtr[f"{p}_seq_std"] = std_bessel(sv)
        mtr[f"{p}_seq_max"], mtr[f"{p}_seq_min"] = max(sv), min(sv)
        mtr[f"{p}_seq_max_deviation"] = max(abs(x) for x in sv)
        mtr[f"{p}_seq_fraction_high"] = sum(x > hi for x in sv) / len(sv)
        if is_k1:
            mtr[f"{p}_seq_fraction_low"] = sum(x < lo for x in sv) / len(sv)
        mtr[f"{p}_masked_fraction"] = masked_mean([[0.0 if k else 1.0 for k in r] for r in keep], mask)
        row_kept = [all(k or not m for k, m in zip(kr, mr)) for kr, mr in zip(keep, mask)]
        mtr[f"{p}_seq_masked_fraction"] = sum(not row_kept[i] for i in valid_rows) / len(valid_rows)
        combined = [[c * (1.0 if k else 0.0) for c, k in zip(cr, kr)] for cr, kr in zip(combined, keep)]
    new_mask = mask
    if cfg.rs:
        mtr["rollout_rs_masked_fraction"] = masked_mean([[1 - c for c in r] for r in combined], mask)
        hit = [any(m and c <= 0.5 for c, m in zip(cr, mr)) for cr, mr in zip(combined, mask)]
        mtr["rollout_rs_seq_masked_fraction"] = sum(hit) / rows
        new_mask = [[m * c for m, c in zip(mr, cr)] for mr, cr in zip(mask, combined)]
    # off-policy diagnostics
    lpt = [row_mean(r, mr) for r, mr in zip(train, mask)]
    lpr = [row_mean(r, mr) for r, mr in zip(rollout, mask)]
    mtr["training_ppl"] = sum(math.exp(-x) for x in lpt) / rows
    mtr["training_log_ppl"] = sum(-x for x in lpt) / rows
    mtr["kl"] = masked_mean([[b - a for a, b in zip(tr, rr)] for tr, rr in zip(train, rollout)], mask)
    mtr["k3_kl"] = masked_mean([[math.exp(x) - x - 1 for x in r] for r in lr], mask)
    mtr["rollout_ppl"] = sum(math.exp(-x) for x in lpr) / rows
    mtr["rollout_log_ppl"] = sum(-x for x in lpr) / rows
    d = [b - a for a, b in zip(lpt, lpr)]
    mtr["log_ppl_diff"] = sum(d) / rows
    mtr["log_ppl_abs_diff"] = sum(abs(x) for x in d) / rows
    mtr["log_ppl_diff_max"], mtr["log_ppl_diff_min"] = max(d), min(d)
    mtr["ppl_ratio"] = sum(math.exp(x) for x in d) / rows
    mtr["chi2_token"] = masked_mean([[math.exp(clamp(x, -20, 20)) ** 2 for x in r] for r in lr], mask) - 1.0
    sums2 = [clamp(sum(x * m for x, m in zip(r, mr)), -20, 20) for r, mr in zip(lr, mask)]
    mtr["chi2_seq"] = sum(math.exp(2 * s) for s in sums2) / rows - 1.0
    return weights, new_mask, mtr
