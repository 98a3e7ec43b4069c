"""A real, tiny on-policy RL trainer (CPU, minutes) that writes its runs through ``rldiag.capture``.

It learns a verifiable toy task (digit sums, with a calculator tool whose observation tokens
have ``response_mask`` 0), samples on a bfloat16 copy of the policy while training in float32
(so ``rollout_log_probs`` genuinely differ from ``old_log_probs``), and trains with GRPO or PPO
with a critic (GAE) over several mini-batches, computing and logging its own metrics under
verl's names with its own code (``rldiag.toy.algos``; it never calls ``rldiag.engine``).

Modules: ``task`` (the environment), ``model`` (the transformer), ``rollout`` (sampling),
``engine`` (the rollout engine's log-probs and the gap causes it can produce), ``corpus`` and
``corpus_gap`` (the calibration corpus),
``algos`` (advantages, losses), ``update`` (mini-batch updates), ``metrics`` (data metrics),
``config`` (settings and presets), ``trainer`` (the loop), ``make_samples`` (samples/).
"""

from importlib import import_module

__all__ = ["PRESETS", "RunSummary", "StepResult", "ToyConfig", "ToyTrainer", "grpo_tool", "ppo_gae"]

_WHERE = {
    "PRESETS": "config", "ToyConfig": "config", "grpo_tool": "config", "ppo_gae": "config",
    "RunSummary": "trainer", "StepResult": "trainer", "ToyTrainer": "trainer",
}


def __getattr__(name: str):
    """Lazy: importing ``rldiag.toy.config`` (the CLI does, for the presets) must not load torch."""
    if name in _WHERE:
        return getattr(import_module(f"rldiag.toy.{_WHERE[name]}"), name)
    raise AttributeError(name)
