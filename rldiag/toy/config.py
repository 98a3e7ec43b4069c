"""The toy trainer's settings, two presets, and their verl-keyed form for ``run.yaml``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from rldiag.errors import ConfigError


@dataclass(frozen=True)
class ToyConfig:
    """Everything one toy run depends on (with ``seed``, the run is deterministic).

    Batch arithmetic as verl's: a step samples ``prompts_per_step`` prompts ``n`` times each;
    the actor and the critic update on mini-batches of ``mini_batch_prompts * n`` rows, in batch
    order (no shuffle), one micro-batch per mini-batch, ``ppo_epochs`` passes.
    """

    adv_estimator: str = "grpo"  # "grpo" or "gae" (the latter trains a critic)
    steps: int = 30
    prompts_per_step: int = 8
    n: int = 8
    mini_batch_prompts: int = 1
    ppo_epochs: int = 1
    min_digits: int = 2
    max_digits: int = 4
    max_response_length: int = 12
    tool: bool = True
    tool_failure: float = 0.3
    partial_credit: float = 0.5
    length_bonus: float = 0.0  # an exploitable reward component: this times the share of the width the actor wrote
    bonus_digits_only: bool = False  # the bonus counts only the digits the actor wrote ("shown working")
    temperature: float = 1.0
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    actor_lr: float = 1e-3
    critic_lr: float = 1e-2
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 1e-3
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.01
    kl_loss_type: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_coef: float = 0.01
    gamma: float = 1.0
    lam: float = 0.95
    norm_adv_by_std_in_grpo: bool = True
    cliprange_value: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.adv_estimator not in ("grpo", "gae"):
            raise ConfigError(f"toy trainer: adv_estimator must be grpo or gae, not {self.adv_estimator!r}")
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ConfigError("toy trainer: prompts_per_step must be a multiple of mini_batch_prompts")
        if self.d_model % self.n_heads:
            raise ConfigError("toy trainer: d_model must be a multiple of n_heads")
        if self.length_bonus < 0:
            raise ConfigError("toy trainer: length_bonus must be >= 0")
        if self.steps < 1 or self.ppo_epochs < 1:
            raise ConfigError("toy trainer: steps and ppo_epochs must be >= 1")

    @property
    def critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.n

    @property
    def mini_batch_rows(self) -> int:
        """Rows per optimizer step (verl multiplies ppo_mini_batch_size by rollout.n)."""
        return self.mini_batch_prompts * self.n

    @property
    def max_prompt_length(self) -> int:
        return self.max_digits + 1

    def with_(self, **changes) -> ToyConfig:
        return replace(self, **changes)

    def verl_config(self) -> dict:
        """The run's config under verl's nested keys (what ``run.yaml`` holds)."""
        return {
            "algorithm": {
                "adv_estimator": self.adv_estimator,
                "gamma": self.gamma,
                "lam": self.lam,
                "norm_adv_by_std_in_grpo": self.norm_adv_by_std_in_grpo,
                "use_kl_in_reward": self.use_kl_in_reward,
                "kl_penalty": self.kl_penalty,
                "kl_ctrl": {"type": "fixed", "kl_coef": self.kl_coef},
            },
            "actor_rollout_ref": {
                "actor": {
                    "ppo_mini_batch_size": self.mini_batch_prompts,
                    "ppo_micro_batch_size_per_gpu": self.mini_batch_rows,
                    "ppo_epochs": self.ppo_epochs,
                    "shuffle": False,
                    "use_dynamic_bsz": False,
                    "clip_ratio": self.clip_ratio,
                    "clip_ratio_low": None,
                    "clip_ratio_high": self.clip_ratio_high,
                    "clip_ratio_c": self.clip_ratio_c,
                    "loss_agg_mode": "token-mean",
                    "entropy_coeff": self.entropy_coeff,
                    "use_kl_loss": self.use_kl_loss,
                    "kl_loss_coef": self.kl_loss_coef,
                    "kl_loss_type": self.kl_loss_type,
                    "policy_loss": {"loss_mode": "vanilla"},
                    "grad_clip": self.grad_clip,
                    "optim": {"lr": self.actor_lr},
                },
                "rollout": {"n": self.n, "temperature": self.temperature, "dtype": "bfloat16",
                            "calculate_log_probs": True},
                "model": {"path": "rldiag.toy.model.TinyTransformer", "d_model": self.d_model,
                          "n_heads": self.n_heads, "n_layers": self.n_layers},
            },
            "critic": {
                "enable": self.critic,
                "ppo_mini_batch_size": self.mini_batch_prompts,
                "ppo_micro_batch_size_per_gpu": self.mini_batch_rows,
                "ppo_epochs": self.ppo_epochs,
                "cliprange_value": self.cliprange_value,
                "loss_agg_mode": "token-mean",
                "grad_clip": self.grad_clip,
                "optim": {"lr": self.critic_lr},
            },
            "data": {
                "train_batch_size": self.prompts_per_step,
                "max_prompt_length": self.max_prompt_length,
                "max_response_length": self.max_response_length,
            },
            "trainer": {"total_training_steps": self.steps, "seed": self.seed, "project_name": "rldiag-toy"},
            "toy": {"task": "digit-sum with a calculator tool", "tool": self.tool, "tool_failure": self.tool_failure,
                    "min_digits": self.min_digits, "max_digits": self.max_digits,
                    "partial_credit": self.partial_credit,
                    **({"length_bonus": self.length_bonus, "bonus_digits_only": self.bonus_digits_only}
                       if self.length_bonus else {})},
        }

    def as_dict(self) -> dict:
        return asdict(self)


def grpo_tool(**changes) -> ToyConfig:
    """GRPO, 8 samples per prompt, KL loss against the reference, clip-higher; tool turns."""
    base = ToyConfig(adv_estimator="grpo", prompts_per_step=8, n=8, mini_batch_prompts=1, clip_ratio_high=0.28,
                     use_kl_loss=True, seed=1)
    return base.with_(**changes)


def ppo_gae(**changes) -> ToyConfig:
    """PPO with a critic and GAE (lam 0.95), KL penalty in the reward; one sample per prompt."""
    base = ToyConfig(adv_estimator="gae", prompts_per_step=64, n=1, mini_batch_prompts=8, use_kl_in_reward=True,
                     seed=2)
    return base.with_(**changes)


PRESETS = {"grpo-tool": grpo_tool, "ppo-gae": ppo_gae}
