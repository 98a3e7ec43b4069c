"""A reward function as verl names and calls it: found, loaded, called, its result read.

Named by ``--reward``:

- ``FILE.py:NAME``: the function ``NAME`` of a Python file, loaded as verl loads
  ``reward.custom_reward_function.path`` (``verl/trainer/ppo/reward.py``, ``get_custom_reward_fn``:
  the file executed as a module of its own);
- ``MODULE:NAME``: a function of an importable module (``rldiag.toy.task:compute_score``);
- ``verl:default``: verl's ``default_compute_score`` (``verl/utils/reward_score/__init__.py``),
  when verl is installed; its data sources that run model-written code (``prime_code``,
  ``sandbox_fusion``: :data:`CODE_EXEC_SOURCES`) are refused unless asked for;
- ``from-config``: the run's own, named by its config's ``reward.custom_reward_function.path`` /
  ``.name`` (the older top-level ``custom_reward_function`` too), with its ``reward_kwargs``
  merged into every call. Never the default: nothing named in a run's config runs unless asked.

A call is made by keyword, as verl's reward managers make it (``data_source=``,
``solution_str=``, ``ground_truth=``, ``extra_info=``; ``async def`` functions are run to
completion), and its result read as verl reads it (:func:`read_result`): a number, or a mapping
with ``"score"`` whose other keys are reward components. The reward manager around the call
(:class:`Manager`): ``naive`` (the score as it is) or ``dapo`` (its overlong penalty added, from the
run's config, ``verl/experimental/reward_loop/reward_manager/dapo.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldiag.errors import RewardError

#: ``verl:default``'s data sources whose scoring runs model-written code (prime_code) or calls a
#: sandbox (sandbox_fusion): refused unless ``--allow-code-exec``
CODE_EXEC_SOURCES = frozenset({"codecontests", "apps", "codeforces", "taco"})
VERL_DEFAULT = "verl:default"
FROM_CONFIG = "from-config"
VERL_DEFAULT_MODULE, VERL_DEFAULT_NAME = "verl.utils.reward_score", "default_compute_score"
#: the config keys of the run's reward function: verl's current ones, then the older top-level ones
CONFIG_PREFIXES = ("reward.custom_reward_function", "custom_reward_function")
#: the reward managers a rescore reproduces (``reward.reward_manager.name``; older
#: ``reward_model.reward_manager``)
MANAGERS = ("naive", "dapo")


@dataclass(frozen=True)
class RewardFunction:
    """Where a reward function is and how it is called.

    Attributes:
        spec: ``--reward`` as given.
        name: the function's name in its file or module.
        file: the file defining it (resolved), where known.
        module: the module imported to reach it (None: ``file`` is executed as a module).
        sha256: the SHA-256 of ``file``'s bytes.
        kwargs: keyword arguments merged into every call (``reward_kwargs`` of the run's config).
    """

    spec: str
    name: str
    file: str | None = None
    module: str | None = None
    sha256: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def verl_default(self) -> bool:
        return self.module == VERL_DEFAULT_MODULE and self.name == VERL_DEFAULT_NAME

    def record(self) -> dict[str, Any]:
        """What ``scenario.json`` records of it."""
        return {"spec": self.spec, "name": self.name, "file": self.file, "module": self.module,
                "sha256": self.sha256, "kwargs": self.kwargs}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config_function(config: Mapping[str, Any], run_dir: Path | None) -> tuple[Path, str, dict[str, Any]]:
    """``(file, name, reward_kwargs)`` named by a flattened run config (dotted keys)."""
    for prefix in CONFIG_PREFIXES:
        path = config.get(f"{prefix}.path")
        if path:
            name = str(config.get(f"{prefix}.name") or "compute_score")
            head = f"{prefix}.reward_kwargs."
            kwargs: dict[str, Any] = {}
            for key, value in config.items():
                if key.startswith(head):
                    node = kwargs
                    *parents, last = key[len(head):].split(".")
                    for part in parents:
                        node = node.setdefault(part, {})
                    node[last] = value
            file = Path(str(path)).expanduser()
            if not file.is_absolute() and not file.exists() and run_dir is not None and (run_dir / file).exists():
                file = run_dir / file  # relative to where training ran, else to the run
            return file, name, kwargs
    raise RewardError("--reward from-config: the run's config names no reward function "
                      f"({CONFIG_PREFIXES[0]}.path, or the older {CONFIG_PREFIXES[1]}.path)")


def resolve_reward(spec: str, config: Mapping[str, Any] | None = None, run_dir: Path | None = None) -> RewardFunction:
    """The function ``spec`` names (see the module docstring). ``config``: the run's settings as
    dotted keys (for ``from-config``). Checks that the file or module exists; loads nothing."""
    spec = spec.strip()
    if spec == FROM_CONFIG:
        file, name, kwargs = _config_function(config or {}, run_dir)
        if not file.is_file():
            raise RewardError(f"--reward from-config: {file} (the run's reward.custom_reward_function.path) "
                              "is not a file")
        return RewardFunction(spec, name, str(file.resolve()), None, _sha256(file), kwargs)
    if spec == VERL_DEFAULT:
        return _module_function(spec, VERL_DEFAULT_MODULE, VERL_DEFAULT_NAME)
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise RewardError(f"--reward {spec!r}: expected FILE.py:NAME, MODULE:NAME, verl:default or from-config")
    if target.endswith(".py") or "/" in target or "\\" in target:
        file = Path(target).expanduser()
        if not file.is_file():
            raise RewardError(f"--reward {spec!r}: {file} is not a file")
        return RewardFunction(spec, name, str(file.resolve()), None, _sha256(file))
    return _module_function(spec, target, name)


def _module_function(spec: str, module: str, name: str) -> RewardFunction:
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        found, why = None, f": {exc}"
    else:
        why = ""
    if found is None:
        hint = " (verl is not installed)" if module.startswith("verl") else ""
        raise RewardError(f"--reward {spec!r}: no module {module!r}{hint}{why}")
    origin = found.origin if found.origin and Path(found.origin).is_file() else None
    return RewardFunction(spec, name, origin, module, _sha256(Path(origin)) if origin else None)


def load_function(fn: RewardFunction) -> Callable[..., Any]:
    """The callable (imports the module, or executes the file as a module of its own)."""
    try:
        if fn.module is not None:
            module = importlib.import_module(fn.module)
        else:
            assert fn.file is not None
            mod_name = f"rldiag_reward_{(fn.sha256 or '')[:12]}"
            loader_spec = importlib.util.spec_from_file_location(mod_name, fn.file)
            if loader_spec is None or loader_spec.loader is None:
                raise RewardError(f"--reward {fn.spec!r}: cannot load {fn.file} as Python")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
    except RewardError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's module failed to import: say how
        raise RewardError(f"--reward {fn.spec!r}: loading {fn.file or fn.module} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    obj = getattr(module, fn.name, None)
    if obj is None or not callable(obj):
        raise RewardError(f"--reward {fn.spec!r}: {fn.file or fn.module} has no function {fn.name!r}")
    return obj


def call_function(func: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """One call by keyword, as verl's reward manager makes it; an ``async def`` function (or
    one returning an awaitable) is run to completion here."""
    out = func(**kwargs)
    if inspect.isawaitable(out):
        async def wait() -> Any:
            return await out
        out = asyncio.run(wait())
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if not isinstance(value, (str, bytes)) else None


def read_result(result: Any) -> tuple[float, dict[str, float]]:
    """``(score, components)`` of a reward function's result, as verl's naive manager reads it:
    a mapping's ``"score"`` and its other numeric keys (non-numbers are left out); a number is the
    score and, as verl records it, the component ``acc``. Raises TypeError / KeyError for
    anything else (the row's call fails)."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise KeyError(f"the result {sorted(map(str, result))} has no 'score'")
        score = _number(result["score"])
        if score is None:
            raise TypeError(f"'score' is {type(result['score']).__name__}, not a number")
        comps = {str(k): n for k, v in result.items() if k != "score" and (n := _number(v)) is not None}
        return score, comps
    score = _number(result)
    if score is None or isinstance(result, (list, tuple)):
        raise TypeError(f"returned {type(result).__name__}; expected a number or a dict with 'score'")
    return score, {"acc": score}


@dataclass(frozen=True)
class Manager:
    """The reward manager around the function: ``naive``, or ``dapo`` with its overlong penalty
    (``penalty_len`` > 0 when enabled: ``min(-(length - (max_len - penalty_len)) / penalty_len *
    factor, 0)`` added to the score; with ``log``, components ``overlong_reward`` and ``overlong``)."""

    name: str = "naive"
    penalty_len: int = 0
    max_len: int = 0
    factor: float = 1.0
    log: bool = False

    def apply(self, score: float, components: dict[str, float], length: int) -> float:
        """The row's score after the manager (``length``: its valid response length)."""
        if self.penalty_len <= 0:
            return score
        overlong = min(-(length - (self.max_len - self.penalty_len)) / self.penalty_len * self.factor, 0)
        if self.log:
            components["overlong_reward"] = float(overlong)
            components["overlong"] = float(overlong < 0)
        return score + overlong

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "overlong_buffer_len": self.penalty_len, "max_resp_len": self.max_len,
                "penalty_factor": self.factor}


def manager_of(config: Mapping[str, Any]) -> Manager:
    """The run's reward manager (dotted config keys); RewardError for one a rescore does not reproduce."""
    name = config.get("reward.reward_manager.name") or config.get("reward_model.reward_manager") or "naive"
    if name not in MANAGERS:
        raise RewardError(f"the run's reward manager {name!r} is not supported by rescore (supported: "
                          f"{', '.join(MANAGERS)}): its scores are not a per-row function of the reply")
    if name != "dapo":
        return Manager(str(name))
    for head, max_key in (("reward.reward_kwargs.overlong_buffer_cfg", "reward.reward_kwargs.max_resp_len"),
                          ("reward_model.overlong_buffer", "data.max_response_length")):
        if config.get(f"{head}.enable"):
            length, max_len = int(config.get(f"{head}.len") or 0), config.get(max_key) or config.get(
                "data.max_response_length")
            if length <= 0 or max_len is None or int(max_len) < length:
                raise RewardError(f"dapo's overlong buffer: {head}.len={length} and max_resp_len={max_len}: the "
                                  "buffer must be positive and no longer than the maximum response length")
            factor = float(config.get(f"{head}.penalty_factor", 1.0))
            if not math.isfinite(factor):
                raise RewardError(f"dapo's overlong buffer: {head}.penalty_factor={factor} is not finite")
            return Manager("dapo", length, int(max_len), factor, bool(config.get(f"{head}.log", False)))
    return Manager("dapo")
