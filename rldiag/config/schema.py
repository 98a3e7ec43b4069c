"""Every setting rldiag reads, declared once.

One row per key: verl's dotted key (or rldiag's own under ``rldiag.``), its default (verl's, ``None``
for verl's ``null``), its type, its valid range, the extra words it takes, a line of help, what
differs between verl releases, and, for the keys the app's What-if page edits, the widget's bounds.
Everything else is derived from this table: the defaults and coercion of
:mod:`rldiag.config.settings` (``--set`` parsing included), the range checks (:func:`check_range`),
the What-if widgets (:func:`widget`), and the settings table of ``docs/settings.md``
(:func:`markdown_table`, kept equal to the file by a test). Adding a setting is adding a row here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rldiag.config.ranges import FLOAT, FLOAT32_MAX, INT, INT32_MAX, Range

Kind = Literal["bool", "float", "int", "str", "list[str]", "list[float]"]


@dataclass(frozen=True)
class Widget:
    """A number input's bounds on the What-if page (the range a person explores, inside the valid one)."""

    label: str
    lo: float
    hi: float
    step: float
    fmt: str | None = None


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    kind: Kind
    help: str
    range: Range | None = None  # numeric kinds: None is any finite float32 / int32
    words: tuple[str, ...] = ()  # strings an int setting also takes ("auto", "run")
    choices: str | None = None  # the registry whose keys are the valid values (documentation)
    values: tuple[str, ...] = ()  # the strings a str setting takes, when no registry lists them (documentation)
    releases: str = ""  # what differs between verl releases (rldiag/config/verl_versions.py)
    widget: Widget | None = None
    #: the key whose value a null of this one takes (verl's interpolations, e.g. the critic's batch keys the
    #: actor's); :func:`effective` reads it, for every reader of a setting (Settings, the engine, the doctor)
    inherits: str | None = None
    #: the app's What-if page edits it (a number widget's bounds: ``widget``; the choices: ``choices`` / ``values``)
    whatif: bool = False

    @property
    def valid(self) -> Range:
        """The valid range of a numeric setting."""
        if self.range is not None:
            return self.range
        return INT if self.kind == "int" else FLOAT

    @property
    def rldiag_own(self) -> bool:
        return self.key.startswith("rldiag.")


_A = "actor_rollout_ref.actor"
_P = f"{_A}.policy_loss"
_RC = "algorithm.rollout_correction"
_BRC = f"{_P}.rollout_correction"
_NONNEG = Range(0.0, FLOAT32_MAX)
_POSITIVE = Range(0.0, FLOAT32_MAX, lo_open=True)
_DIVISOR = Range(0.0, FLOAT32_MAX, lo_open=True, why="the loss is divided by it")
_COUNT = Range(1, INT32_MAX)
_TOKENS = Range(1, INT32_MAX, why="tokens")
_BUDGET = Range(1, INT32_MAX, why="tokens per micro-batch")
#: a torch.Generator seed (verl seeds data_loader_seed + rank), within an int32 as every count here
_SEED = Range(0, INT32_MAX, why="a torch.Generator seed")
_FRACTION = Range(0.0, 1.0, why="a fraction of the tokens")
_R = "actor_rollout_ref.rollout"

SETTINGS: tuple[Setting, ...] = (
    # ---- advantage estimation
    Setting("algorithm.adv_estimator", "gae", "str", "the advantage estimator", choices="ESTIMATORS", whatif=True),
    Setting("algorithm.gamma", 1.0, "float", "discount factor of the returns", Range(0.0, 1.0, why="a discount factor")),
    Setting("algorithm.lam", 1.0, "float", "GAE's lambda", Range(0.0, 1.0, why="GAE's lambda")),
    Setting("algorithm.norm_adv_by_std_in_grpo", True, "bool",
            "divide GRPO's group-centred scores by the group's std (false: Dr. GRPO)", whatif=True),
    Setting("algorithm.gdpo_reward_keys", None, "list[str]",
            "gdpo: the reward-component columns to normalise (a comma list on the command line)"),
    Setting("algorithm.gdpo_reward_weights", None, "list[float]", "gdpo: the components' weights (default 1 each)"),
    # ---- the group filter (DAPO's dynamic sampling; verl's V1 replay buffer)
    Setting("algorithm.filter_groups.enable", False, "bool",
            "drop each step's groups (rows sharing a uid) of 2+ rows whose filter_groups.metric is the same on every "
            "row; on a recorded batch the dropped groups are not refilled (verl samples more prompts)"),
    Setting("algorithm.filter_groups.metric", "reward", "str",
            "the group filter's per-row metric: reward (the row's summed token_level_scores), seq_reward (the same), "
            "seq_final_reward (its summed token_level_rewards, KL penalty included), score, or a scalar column",
            releases="reward is verl's V1 replay buffer's canonical metric and the default of ppo_trainer.yaml from "
            "0.9.0; before, only the DAPO recipe filters (its config sets acc; verl's FilterGroupsConfig: null) and "
            "reads reward as a column"),
    # ---- KL in the reward
    Setting("algorithm.use_kl_in_reward", False, "bool", "subtract a KL penalty to the reference from the token rewards",
            whatif=True),
    Setting("algorithm.kl_penalty", "kl", "str", "the KL estimator of the reward penalty", choices="KL_ESTIMATORS", whatif=True),
    Setting("algorithm.kl_ctrl.type", "fixed", "str", "the KL coefficient's controller", values=("fixed", "adaptive"),
            whatif=True),
    Setting("algorithm.kl_ctrl.kl_coef", 0.001, "float", "the (initial) KL coefficient", _NONNEG,
            widget=Widget("kl_ctrl.kl_coef", 0.0, 1000.0, 0.001, "%.4f"), whatif=True),
    Setting("algorithm.kl_ctrl.target_kl", 0.1, "float", "the adaptive controller's target KL", _NONNEG),
    Setting("algorithm.kl_ctrl.horizon", 10000, "int", "the adaptive controller's horizon",
            Range(1, INT32_MAX, why="steps; the adaptive controller divides by it")),
    # ---- rollout correction (the algorithm's block)
    Setting(f"{_RC}.rollout_is", None, "str", "IS weights of the rollout policy: token or sequence (null: off)",
            choices="IS_LEVELS", whatif=True),
    Setting(f"{_RC}.rollout_is_threshold", 2.0, "str",
            "truncate IS weights above it, or lower_upper to zero them outside (a number or a string)", whatif=True),
    Setting(f"{_RC}.rollout_is_batch_normalize", False, "bool", "normalise the IS weights to mean 1 over the batch", whatif=True),
    Setting(f"{_RC}.rollout_rs", None, "str", "rejection sampling options, a comma list (null: off)", choices="RS_OPTIONS",
            whatif=True),
    Setting(f"{_RC}.rollout_rs_threshold", None, "str", "the rejection options' thresholds", whatif=True),
    Setting(f"{_RC}.bypass_mode", False, "bool", "use the rollout's log-probs as the PPO anchor (no recomputed pi_old)",
            whatif=True),
    # ---- the actor's loss
    Setting(f"{_P}.loss_mode", "vanilla", "str", "the policy loss", choices="POLICY_LOSSES", whatif=True),
    Setting(f"{_A}.clip_ratio", 0.2, "float", "PPO's clip range (both sides unless low / high are set)", _NONNEG),
    Setting(f"{_A}.clip_ratio_low", None, "float", "the lower clip range", _NONNEG,
            widget=Widget("clip_ratio_low", 0.0, 10.0, 0.01, "%.3f"), inherits=f"{_A}.clip_ratio", whatif=True),
    Setting(f"{_A}.clip_ratio_high", None, "float", "the upper clip range", _NONNEG,
            widget=Widget("clip_ratio_high", 0.0, 10.0, 0.01, "%.3f"), inherits=f"{_A}.clip_ratio", whatif=True),
    Setting(f"{_A}.clip_ratio_c", 3.0, "float", "dual-clip PPO's bound for negative advantages (> 1)",
            widget=Widget("clip_ratio_c (dual clip)", 1.0, 100.0, 0.5), whatif=True),
    Setting(f"{_A}.loss_agg_mode", "token-mean", "str", "how token losses are aggregated", choices="AGG_MODES", whatif=True),
    Setting(f"{_A}.loss_scale_factor", None, "float", "a fixed divisor of seq-mean-token-sum-norm (null: the horizon)",
            _DIVISOR),
    Setting(f"{_A}.use_kl_loss", False, "bool", "add a KL-to-reference term to the actor's loss", whatif=True),
    Setting(f"{_A}.kl_loss_type", "low_var_kl", "str", "the KL estimator of the KL loss", choices="KL_ESTIMATORS", whatif=True),
    Setting(f"{_A}.kl_loss_coef", 0.001, "float", "the KL loss's coefficient", _NONNEG,
            widget=Widget("kl_loss_coef", 0.0, 1000.0, 0.001, "%.4f"), whatif=True),
    Setting(f"{_A}.entropy_coeff", 0.0, "float", "the entropy bonus's coefficient"),
    Setting(f"{_A}.tau_pos", 1.0, "float", "SAPO's temperature for positive advantages",
            Range(0.0, FLOAT32_MAX, lo_open=True, why="SAPO divides by it")),
    Setting(f"{_A}.tau_neg", 1.05, "float", "SAPO's temperature for negative advantages",
            Range(0.0, FLOAT32_MAX, lo_open=True, why="SAPO divides by it")),
    Setting(f"{_P}.clip_cov_ratio", 0.0002, "float", "clip_cov: the share of tokens clipped", _FRACTION),
    Setting(f"{_P}.clip_cov_lb", 1.0, "float", "clip_cov: the covariance's lower bound"),
    Setting(f"{_P}.clip_cov_ub", 5.0, "float", "clip_cov: the covariance's upper bound"),
    Setting(f"{_P}.kl_cov_ratio", 0.0002, "float", "kl_cov: the share of tokens penalised", _FRACTION),
    Setting(f"{_P}.ppo_kl_coef", 0.1, "float", "kl_cov: the KL penalty's coefficient", _NONNEG),
    Setting(f"{_P}.dro_beta", None, "float", "dro: the regulariser's beta", _POSITIVE),
    # ---- the rollout-correction block loss_mode=bypass_mode reads
    Setting(f"{_BRC}.loss_type", "ppo_clip", "str", "bypass_mode's loss: ppo_clip or reinforce"),
    Setting(f"{_BRC}.rollout_is", None, "str", "bypass_mode: IS weights (token or sequence; null: off)",
            choices="IS_LEVELS"),
    Setting(f"{_BRC}.rollout_is_threshold", 2.0, "str", "bypass_mode: the IS threshold"),
    Setting(f"{_BRC}.rollout_is_batch_normalize", False, "bool", "bypass_mode: normalise the IS weights"),
    Setting(f"{_BRC}.rollout_rs", None, "str", "bypass_mode: rejection options", choices="RS_OPTIONS"),
    Setting(f"{_BRC}.rollout_rs_threshold", None, "str", "bypass_mode: the rejection thresholds"),
    # ---- the critic
    Setting("critic.enable", None, "bool",
            "whether the trainer has a critic (null: exactly when adv_estimator is gae, verl's need_critic)"),
    Setting("critic.cliprange_value", 0.5, "float", "the value loss's clip range", _NONNEG),
    Setting("critic.loss_agg_mode", None, "str", "the value loss's aggregation", choices="AGG_MODES",
            inherits=f"{_A}.loss_agg_mode"),
    Setting("critic.loss_scale_factor", None, "float", "the value loss's fixed divisor", _DIVISOR,
            inherits=f"{_A}.loss_scale_factor",
            releases="verl >= 0.9.0 normalises the value loss with the actor's global token count and batch size"),
    # ---- the rollout's sampling (what the rollout-vs-trainer log-prob mismatch is measured against; not val_kwargs)
    Setting(f"{_R}.temperature", 1.0, "float",
            "the rollout's sampling temperature; the trainer divides its logits by it too, so it is no mismatch by itself",
            Range(0.0, FLOAT32_MAX, why="0: greedy")),
    Setting(f"{_R}.top_p", 1.0, "float",
            "nucleus sampling (1: off); below 1 the engine's processed log-probs are renormalised over the nucleus, "
            "the trainer's are not", Range(0.0, 1.0, lo_open=True, why="a probability mass")),
    Setting(f"{_R}.top_k", -1, "int",
            "top-k sampling (-1 in vLLM, 0 in HF: off); on, the engine's processed log-probs are renormalised over "
            "the k tokens, the trainer's are not", Range(-1, INT32_MAX, why="-1 and 0: off")),
    Setting(f"{_R}.logprobs_mode", "processed_logprobs", "str",
            "what vLLM returns as rollout_log_probs: processed_logprobs after temperature and top-k/top-p "
            "(renormalised over the kept tokens), raw_logprobs before them (null: vLLM's own, raw); *_logits are not log-probs",
            values=("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")),
    Setting(f"{_R}.calculate_log_probs", True, "bool",
            "the rollout returns its own log-probs (rollout_log_probs): without them there is nothing to compare",
            releases="false in 0.8.0's rollout.yaml, true from 0.9.0 on; RolloutConfig's dataclass default stays false"),
    # ---- data
    Setting("data.max_response_length", None, "int", "the response cap (null: each step's longest row)", _TOKENS),
    Setting("data.max_prompt_length", None, "int", "the prompt cap (null: each step's longest prompt)", _TOKENS),
    # ---- the trainer and its batch layout
    Setting("trainer.use_v1", None, "bool", "the V1 trainer (null: the release's default)",
            releases="true by default from verl 0.9.0 on"),
    Setting("trainer.balance_batch", True, "bool",
            "balance each step's rows over the DP ranks (the legacy trainer reads it; V1 always balances)"),
    Setting("trainer.critic_warmup", 0, "int", "the first step the actor updates on",
            Range(0, INT32_MAX, why="steps")),
    Setting(f"{_R}.n", None, "int",
            "responses sampled per prompt (a uid group's rows; ppo_mini_batch_size counts prompts, so a mini-batch is "
            "ppo_mini_batch_size x n rows); null: not in the run's config, read as verl's default 1", _COUNT),
    Setting(f"{_A}.ppo_mini_batch_size", None, "int",
            "the actor's mini-batch in prompts; null: not in the run's config (verl's own default is 256): "
            "rldiag.mini_batch_size=run then takes the whole step as one mini-batch", _COUNT),
    Setting(f"{_A}.ppo_micro_batch_size_per_gpu", None, "int",
            "the actor's micro-batch in rows per GPU (verl requires it unless use_dynamic_bsz); null: not in the "
            "run's config (rldiag.micro_batch_size=run then takes each mini-batch whole)", _COUNT),
    Setting(f"{_A}.use_dynamic_bsz", False, "bool", "token-budget micro-batches (verl's rearrange_micro_batches)",
            releases="0.9.1 adds micro-batches until each fits the budget"),
    Setting(f"{_A}.ppo_max_token_len_per_gpu", 16384, "int", "the actor's token budget per micro-batch", _BUDGET),
    Setting(f"{_A}.shuffle", False, "bool", "shuffle each rank's rows (seeded data_loader_seed + rank)"),
    Setting(f"{_A}.data_loader_seed", 42, "int", "the actor's shuffle seed", _SEED),
    Setting("critic.ppo_mini_batch_size", None, "int", "the critic's mini-batch in prompts (verl's interpolation)",
            _COUNT, inherits=f"{_A}.ppo_mini_batch_size"),
    Setting("critic.ppo_micro_batch_size_per_gpu", None, "int",
            "the critic's micro-batch in rows per GPU (verl requires it set; rldiag takes the actor's)", _COUNT,
            inherits=f"{_A}.ppo_micro_batch_size_per_gpu"),
    Setting("critic.use_dynamic_bsz", None, "bool", "the critic's token-budget micro-batches",
            inherits=f"{_A}.use_dynamic_bsz"),
    Setting("critic.ppo_max_token_len_per_gpu", 32768, "int", "the critic's token budget per micro-batch", _BUDGET),
    Setting("critic.shuffle", None, "bool", "shuffle the critic's rows", inherits=f"{_A}.shuffle"),
    Setting("critic.data_loader_seed", 42, "int", "the critic's shuffle seed", _SEED),
    # ---- rldiag's own
    Setting("rldiag.micro_batch_size", "run", "int",
            "rows per micro-batch per DP rank (run: the run's own batch keys when it has them; auto: insist on them; "
            "null: the whole step)", _COUNT, words=("auto", "run")),
    Setting("rldiag.mini_batch_size", "run", "int",
            "rows per mini-batch (ppo_mini_batch_size x rollout.n; run / auto / null as micro_batch_size)", _COUNT,
            words=("auto", "run")),
    Setting("rldiag.dp_size", 1, "int", "data-parallel ranks to emulate", _COUNT),
    Setting("rldiag.verl_version", None, "str",
            "the verl release whose numbers to reproduce (null: the run's recorded one, else the 2026-08 snapshot)"),
    Setting("rldiag.rows_balanced", None, "bool",
            "the batch files hold each step's rows in the trainer's order after balancing (null: true for a run "
            "rldiag's verl capture wrote)"),
    Setting("rldiag.filter.drop_no_signal_from_denominator", False, "bool",
            "groups whose advantages are all 0 leave the update: their rows stay in the batch but count in neither "
            "the loss nor its denominators (token-mean's token count, seq-mean's row count)"),
    Setting("rldiag.filter.gate_column", None, "str",
            "an outcome gate: drop the rows whose scalar column (or seq_reward, seq_final_reward, reward, score) "
            "is below rldiag.filter.gate_min (null: no gate)"),
    Setting("rldiag.filter.gate_min", None, "float", "the outcome gate's threshold (rows below it are dropped)"),
    Setting("rldiag.reward_components", None, "list[str]",
            "per-row batch columns that are reward components (e.g. acc,fmt): the health stage writes each one's step "
            "mean and the top one's share, for the doctor's reward_hacking_component (null: none)"),
    Setting("rldiag.mismatch.enable", True, "bool",
            "compute the rollout-vs-trainer log-prob mismatch fingerprints (rldiag/mismatch/*) when the batches have "
            "rollout_log_probs and old_log_probs"),
    # ---- what rldiag's verl capture records in run.yaml (rldiag/capture/verl.py, run_config): facts about the
    # trainer that wrote the run, which the recompute reads; nobody sets them. The capture itself has no settings
    # here: RLDIAG_CAPTURE_* environment variables configure it (docs/capture.md)
    Setting("rldiag.capture.verl_version", None, "str",
            "recorded by the capture: the trainer's verl.__version__ (the release a recompute reproduces unless "
            "rldiag.verl_version says otherwise)"),
    Setting("rldiag.capture.trainer", None, "str",
            "recorded by the capture: the trainer whose fit it wrapped; its batch files hold the rows in that "
            "trainer's dispatch order (rldiag.rows_balanced unset: true)", values=("legacy", "v1")),
    Setting("rldiag.capture.trainer_mode", None, "str",
            "recorded by the capture: the V1 trainer's trainer.v1.trainer_mode"),
    # the capture policy it ran under (rldiag/capture/policy.py; set by RLDIAG_CAPTURE_EVERY / _GROUPS / _MAX_GB)
    Setting("rldiag.capture.every", 1, "int",
            "recorded by the capture: its batches are of every N-th step (and of the first and last steps)", _COUNT),
    Setting("rldiag.capture.groups", None, "float",
            "recorded by the capture: the prompt groups kept per step, a count (>= 1) or a share in (0, 1) (null: all)",
            _POSITIVE),
    Setting("rldiag.capture.max_gb", None, "float",
            "recorded by the capture: the batch bytes (GB) at which it stopped writing batches (null: no limit)",
            _POSITIVE),
    Setting("rldiag.capture.seed", None, "int",
            "recorded by the capture: the seed of its group draw (with the step)", Range(0, INT32_MAX)),
)


BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


def keys_of(*kinds: Kind) -> frozenset[str]:
    return frozenset(s.key for s in SETTINGS if s.kind in kinds)


#: verl's defaults for every key rldiag reads (``None``: verl's ``null``)
DEFAULTS: dict[str, Any] = {s.key: s.default for s in SETTINGS}
#: the valid range of every numeric setting that has a narrower one than its type's
RANGES: dict[str, Range] = {s.key: s.range for s in SETTINGS if s.range is not None}


def range_of(key: str, integer: bool) -> Range:
    s = BY_KEY.get(key)
    if s is not None and s.range is not None:
        return s.range
    return INT if integer else FLOAT


def check_range(key: str, value: float, integer: bool) -> None:
    """Raise ValueError (the caller names the source) when ``value`` is outside ``key``'s range."""
    r = range_of(key, integer)
    if not r.contains(value):
        raise ValueError(f"{value!r} is outside the valid range {r.describe(key)}")


def effective(values: Mapping[str, Any], key: str) -> Any:
    """``key``'s value in ``values`` as verl reads it: a null takes the value of the key its row
    ``inherits`` (and so on down the chain), e.g. ``critic.ppo_mini_batch_size`` null the actor's,
    ``clip_ratio_high`` null ``clip_ratio``."""
    value, row = values.get(key), BY_KEY.get(key)
    while value is None and row is not None and row.inherits is not None:
        value, row = values.get(row.inherits), BY_KEY.get(row.inherits)
    return value


def needs_critic(values: Mapping[str, Any]) -> bool:
    """Whether the trainer builds, trains and logs a critic: verl's ``need_critic``
    (``verl/trainer/ppo/utils.py``): ``critic.enable`` when set, else ``adv_estimator == "gae"``."""
    enable = values.get("critic.enable")
    if enable is not None:
        return bool(enable)
    return values.get("algorithm.adv_estimator", DEFAULTS["algorithm.adv_estimator"]) == "gae"


def widget(key: str) -> Widget:
    """The What-if page's bounds of a numeric setting it edits."""
    w = BY_KEY[key].widget
    if w is None:
        raise KeyError(f"{key} has no What-if widget declared in rldiag/config/schema.py")
    return w


def _cell(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def markdown_table(settings: Iterable[Setting] = SETTINGS) -> str:
    """The settings table of ``docs/settings.md``: key, default, type, valid values, meaning."""
    lines = ["| key | default | type | valid | meaning |", "| --- | --- | --- | --- | --- |"]
    for s in settings:
        if s.kind in ("float", "int"):
            valid = s.valid.describe(s.key)
            if s.words:
                valid += ", or " + " / ".join(s.words)
        elif s.kind == "bool":
            valid = "true / false"
        elif s.choices:
            valid = f"a key of {s.choices}"
        elif s.values:
            valid = "one of " + " / ".join(f"`{v}`" for v in s.values)
        else:
            valid = ""
        if s.default is None and s.kind != "bool":
            valid += (", " if valid else "") + "or null"
        elif s.default is None:
            valid += " / null"
        meaning = s.help + (f" (null: `{s.inherits}`'s value)" if s.inherits else "")
        meaning += f" (releases: {s.releases})" if s.releases else ""
        lines.append(f"| `{s.key}` | `{_cell(s.default)}` | {s.kind} | {valid} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m rldiag.config.schema > the table of docs/settings.md
    print(markdown_table(), end="")
