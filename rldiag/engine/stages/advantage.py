"""The advantage estimator and verl's data metrics (``compute_advantage``, then
``compute_data_metrics``), both on the mask rollout correction left."""

from __future__ import annotations

from rldiag.engine.advantage import ESTIMATORS, AdvInput, estimate
from rldiag.engine.metrics import data_metrics
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages.base import CheckFamily, Metric, Stage, State
from rldiag.engine.stages.filter import estimate_filtered


def estimator_columns(name: str, settings: EngineSettings | None = None) -> tuple[str, ...]:
    """The columns estimator ``name`` needs: its registration's ``needs=``, and with
    ``settings`` also those its settings name (``needs_fn``: e.g. gdpo's reward components)."""
    meta = ESTIMATORS.meta(name)
    cols = tuple(meta.needs)
    if meta.needs_fn is not None and settings is not None:
        cols += tuple(c for c in meta.needs_fn(settings) if c not in cols)
    return cols


def estimator_optional(name: str) -> tuple[str, ...]:
    """Columns estimator ``name`` reads when the batch has them (its registration's ``optional=``)."""
    return tuple(ESTIMATORS.meta(name).optional)


def _advantages(st: State) -> None:
    s, batch = st.settings, st.batch
    # gae reads the critic's values: verl builds no critic when need_critic is false
    st.use_critic = s.uses_critic
    if s.estimator == "gae" and not st.use_critic:
        st.errors.flag_all("algorithm.adv_estimator=gae needs the critic's values, but critic.enable=false "
                           "(verl's need_critic: the trainer builds no critic); set critic.enable=true or null")
    if st.dropped is None:
        st.adv, st.ret = estimate(s.estimator, AdvInput(batch, st.rewards, st.mask, s, st.errors,
                                                        rollout_is_weights=st.is_weights))
    else:  # the filters dropped rows: the estimator runs on the kept ones (stages/filter.py)
        st.adv, st.ret, st.adv_before = estimate_filtered(st)
    st.tokens.update(advantages=st.adv, returns=st.ret, token_level_rewards=st.rewards, response_mask=st.mask)


ADVANTAGES = Stage(
    "advantages",
    "the advantage estimator algorithm.adv_estimator on the rewards and the rewritten mask "
    "(verl's compute_advantage; on the kept rows alone when the filters dropped some); its columns "
    "are its registration's needs= / optional=",
    _advantages,
    needs_fn=lambda s: estimator_columns(s.estimator, s),
    optional_fn=lambda s: estimator_optional(s.estimator),
    settings=("algorithm.adv_estimator", "algorithm.gamma", "algorithm.lam", "algorithm.norm_adv_by_std_in_grpo",
              "algorithm.gdpo_reward_*", "critic.enable", "rldiag.verl_version"),
    tokens=("advantages", "returns", "token_level_rewards", "response_mask"),
    uses=("rewards", "mask", "is_weights", "dropped", "mask_before"),
    sets=("use_critic", "adv", "ret", "adv_before", "errors"),
)


def _data_metrics(st: State) -> None:
    st.metrics.update(data_metrics(st.batch, st.rewards, st.adv, st.ret, st.mask, st.use_critic))


_D = "data"
_STATS = "{mean,max,min}"
DATA_METRICS = Stage(
    "data_metrics",
    "verl's compute_data_metrics: scores, rewards, advantages, returns, values, lengths, per step",
    _data_metrics,
    optional=("values", "prompt_length", "num_turns", "tool_call_counts"),
    # the values only where a critic is in use (verl's data metrics read them only then)
    optional_fn=lambda s: (("values",) if s.uses_critic else ()) + ("prompt_length", "num_turns", "tool_call_counts"),
    metrics=(
        Metric(f"critic/score/{_STATS}", "the rows' summed token_level_scores (non-aborted rows)", _D),
        Metric(f"critic/rewards/{_STATS}", "the rows' summed token_level_rewards (KL penalty included)", _D),
        Metric(f"critic/advantages/{_STATS}", "the advantages over masked tokens", _D),
        Metric(f"critic/returns/{_STATS}", "the returns over masked tokens", _D),
        Metric(f"critic/values/{_STATS}", "the critic's values over masked tokens", _D, needs=("values",),
               when="a critic in use (`critic.enable`, else `adv_estimator=gae`)"),
        Metric("critic/vf_explained_var", "1 - Var(returns - values) / Var(returns) over masked tokens", _D,
               needs=("values",), when="a critic in use (`critic.enable`, else `adv_estimator=gae`)"),
        Metric("response_length/{mean,max,min,clip_ratio}", "row lengths (every token); clip_ratio: share "
               "at data.max_response_length", _D),
        Metric("response_length_non_aborted/{mean,max,min,clip_ratio}", "the same over non-aborted rows "
               "(length > 0)", _D),
        Metric("response/aborted_ratio", "share of rows without a token", _D),
        Metric("prompt_length/{mean,max,min,clip_ratio}", "prompt lengths; clip_ratio: share at "
               "data.max_prompt_length", _D, needs=("prompt_length",)),
        Metric(f"num_turns/{_STATS}", "the agent loop's turns per row", _D, needs=("num_turns",)),
        Metric(f"training/num_turns/{_STATS}", "the same, as verl's V1 trainer logs it too", _D,
               needs=("num_turns",)),
        Metric(f"tool_call_counts/{_STATS}", "the agent loop's tool calls per row", _D, needs=("tool_call_counts",)),
    ),
    checks=(
        CheckFamily("critic/values/*, vf_explained_var", 5, needs=("values",)),
        CheckFamily("prompt_length/*", 10, needs=("prompt_length",)),
        CheckFamily("num_turns/*", 11, needs=("num_turns",)),
        CheckFamily("tool_call_counts/*", 12, needs=("tool_call_counts",)),
    ),
    uses=("rewards", "adv", "ret", "mask", "use_critic"),
    sets=(),
)
