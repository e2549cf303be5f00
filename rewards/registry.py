"""Reward registry, the TRL-facing wrapper that keeps a failing reward from stopping training, and failure counts.

A reward is a plain function `(prompts, completions, **columns) -> list[float | None]` (TRL's convention):
one value per completion, None where the reward does not apply. Dataset columns (e.g. `answer`) arrive as
keyword arguments, one value per completion; TRL also passes `completion_ids`, `trainer_state`,
`log_metric` and `log_extra`. Options a config may set are keyword-only parameters of the function.

    from rewards import register

    @register("brevity")
    def brevity(prompts, completions, *, scale: float = 1e-3, **kwargs):
        return [-scale * len(c) for c in completions]

`build_rewards([{"name": "math_accuracy", "weight": 1.0}, {"name": "format", "weight": 0.1}])` returns the
wrapped functions and their weights, ready for `GRPOTrainer(reward_funcs=...)` and
`GRPOConfig(reward_weights=...)`.
"""
import difflib
import importlib
import inspect
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from contextvars import ContextVar

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list]
FAILURE_KINDS = ("error", "timeout", "invalid")  # raised / ran out of time / returned NaN or a bad shape

_REGISTRY: dict[str, RewardFunc] = {}
_failures: dict[str, Counter] = defaultdict(Counter)
_last_failure: dict[str, str] = {}  # reward name -> what its last failure was, for RewardsFailing
_logged: set[tuple[str, str]] = set()
_active: ContextVar[str | None] = ContextVar("active_reward", default=None)


def register(name: str | None = None):
    """Decorator: register a reward function under `name` (default: the function's name)."""
    def decorator(func: RewardFunc) -> RewardFunc:
        key = name or func.__name__
        old = _REGISTRY.get(key)
        # Re-registering the same function (a module imported again) is fine; a different one is a clash.
        if old is not None and (old.__module__, old.__qualname__) != (func.__module__, func.__qualname__):
            raise ValueError(f"reward {key!r} is already registered by {old.__module__}.{old.__qualname__}")
        _REGISTRY[key] = func
        return func
    return decorator


def registered() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFunc:
    """A registered reward by name, or any importable function given as "package.module:function"."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        raise KeyError(f"unknown reward {name!r}{_did_you_mean(name, registered())}: registered rewards are "
                       f"{', '.join(registered())}; or name a function as 'package.module:function'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward {name!r}: cannot import module {module_name!r}: {e}") from e
    func = getattr(module, attr, None)
    if not callable(func):
        functions = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise AttributeError(f"reward {name!r}: module {module_name!r} has no function "
                             f"{attr!r}{_did_you_mean(attr, functions)}")
    return func


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------------- failures

def record_failure(kind: str, count: int = 1, message: str = "", exc_info=None):
    """Count `count` completions whose reward failed (`kind` in FAILURE_KINDS) under the reward now running.

    Rewards that handle their own per-completion failures (math_accuracy's grading timeouts) call this;
    SafeReward calls it for everything else. The first failure of each kind per reward is logged as a
    warning, later ones only at debug level: they are counted, which is what the metrics report.
    """
    name = _active.get() or "unnamed"
    _failures[name][kind] += count
    _last_failure[name] = f"{message} ({kind})"
    if (name, kind) not in _logged:
        _logged.add((name, kind))
        logger.warning("reward %r: %s (%s; the completion gets 0; further failures of this kind are counted "
                       "in rewards.failure_counts() and logged at debug level)", name, message, kind,
                       exc_info=exc_info)
    else:
        logger.debug("reward %r: %s (%s)", name, message, kind, exc_info=exc_info)


def failure_counts() -> dict[str, dict[str, int]]:
    """Completions whose reward failed since start (or the last reset): {reward name: {kind: count}}."""
    return {name: {kind: counts[kind] for kind in FAILURE_KINDS} for name, counts in _failures.items()}


def reset_failure_counts():
    _failures.clear()


# ---------------------------------------------------------------------------------------------------- wrapper

class RewardTimeout(RuntimeError):
    pass


class RewardsFailing(RuntimeError):
    """A reward failed on most completions batch after batch: the stage stops rather than train on its zeros."""


class FailureLimit:
    """Stops training once a reward failed on more than `max_share` of a rollout batch's completions for `steps`
    batches in a row (raises RewardsFailing from the reward call, so TRL's step and the stage end there).

    A failure scores 0 and training goes on (SafeReward), which is right for the odd crash. A reward that fails on
    nearly everything (a bug, a missing column, a grader that cannot start) would instead train on zeros to the end,
    and the run would end `done`. TRL scores one rollout batch per optimizer step (per `num_iterations` steps)."""

    def __init__(self, max_share: float = 0.5, steps: int = 3):
        self.max_share, self.steps = max_share, steps
        self._streaks: dict[str, list[str]] = {}  # reward name -> its failing batches in a row, as "failed/total"

    def __repr__(self):
        return f"FailureLimit(max_share={self.max_share}, steps={self.steps})"

    def update(self, name: str, failed: int, total: int, step: int | None = None) -> None:
        if not total or failed / total <= self.max_share:
            self._streaks.pop(name, None)
            return
        streak = self._streaks.setdefault(name, [])
        streak.append(f"{failed}/{total}" + (f" at step {step}" if step is not None else ""))
        if len(streak) >= self.steps:
            raise RewardsFailing(
                f"reward {name!r} failed on more than {self.max_share:.0%} of the completions in {self.steps} rollout "
                f"batches in a row ({', '.join(streak[-self.steps:])}); last failure: "
                f"{_last_failure.get(name, 'unknown')}. Fix the reward or its data, or raise the limit "
                f"(grpo.reward_failure: {{max_share, steps}}; null never stops)")


def _call(func, prompts, completions, kwargs):
    """Runs in a pool worker: `func` is pickled by reference, so it must be importable (module level)."""
    return func(prompts, completions, **kwargs)


class SafeReward:
    """A reward as TRL sees it: options bound, named for TRL's logs, failures turned into 0 and counted.

    TRL logs each reward as `rewards/<__name__>/mean`; this wrapper also logs `rewards/<name>/failed`, the
    fraction of the batch whose reward failed, through TRL's `log_metric` when TRL passes it. A class
    instance rather than a closure so it pickles (TRL and Ray may ship reward functions to other processes).
    """

    def __init__(self, func: RewardFunc, name: str, options: Mapping | None = None, timeout: float | None = None,
                 failure_limit: FailureLimit | None = None):
        if inspect.iscoroutinefunction(func):
            raise TypeError(f"reward {name!r}: async reward functions are not supported")
        self.func = func
        self.__name__ = name
        self.options = dict(options or {})
        self.timeout = timeout  # seconds per batch, in a killable worker process; None: called in this process
        self.failure_limit = failure_limit  # None: failures never stop training

    def __repr__(self):
        return f"SafeReward({self.__name__!r}, {self.func.__module__}.{self.func.__qualname__}, {self.options})"

    def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        token = _active.set(self.__name__)
        before = sum(_failures[self.__name__].values())
        try:
            values = self._batch(prompts, completions, columns)
        finally:
            _active.reset(token)
        failed = sum(_failures[self.__name__].values()) - before
        log_metric = columns.get("log_metric")
        if callable(log_metric) and completions:
            log_metric(f"rewards/{self.__name__}/failed", failed / len(completions))
        if self.failure_limit is not None:
            state = columns.get("trainer_state")
            step = state.global_step + 1 if state is not None else None  # the step this batch trains
            self.failure_limit.update(self.__name__, failed, len(completions), step)
        return values

    def _invoke(self, prompts, completions, columns):
        """The function itself, or, with a timeout, in a worker of the deadline pool that is killed when it hangs."""
        if self.timeout is None:
            return self.func(prompts, completions, **{**columns, **self.options})
        from rewards.pool import shared_pool

        # The trainer's callables and state stay behind: only data crosses to the worker.
        portable = {k: v for k, v in columns.items() if k not in ("log_metric", "log_extra", "trainer_state")}
        status, value = shared_pool().map(_call, [(self.func, prompts, completions, {**portable, **self.options})],
                                          self.timeout)[0]
        if status == "timeout":
            raise RewardTimeout(f"no result within {self.timeout} s")
        if status == "error":
            raise RuntimeError(value)
        return value

    def _batch(self, prompts, completions, columns) -> list[float | None]:
        n = len(completions)
        try:
            values = self._invoke(prompts, completions, columns)
        except RewardTimeout as e:
            # A reward that hangs would hang again completion by completion: the whole batch scores 0.
            record_failure("timeout", n, str(e))
            return [0.0] * n
        except Exception as e:  # any bug in a reward must not stop training
            logger.debug("reward %r raised %s on a batch; retrying completion by completion", self.__name__,
                         type(e).__name__)
            return [self._one(prompts, completions, columns, i) for i in range(n)]
        return self._check(values, n)

    def _one(self, prompts, completions, columns, i) -> float | None:
        """The reward of completion i alone, so that one bad completion does not zero its whole batch."""
        n = len(completions)
        # Per-completion columns are lists of length n; the rest (trainer_state, log_metric, ...) pass as is.
        row = {k: v[i:i + 1] if isinstance(v, list) and len(v) == n else v for k, v in columns.items()}
        try:
            values = self._invoke(prompts[i:i + 1], completions[i:i + 1], row)
        except RewardTimeout as e:
            record_failure("timeout", 1, str(e))
            return 0.0
        except Exception as e:  # any bug in a reward must not stop training
            record_failure("error", 1, f"raised {type(e).__name__}: {e}", exc_info=True)
            return 0.0
        return self._check(values, 1)[0]

    def _check(self, values, n: int) -> list[float | None]:
        """One float (or None) per completion; NaN, non-numbers and a wrong length become 0 and are counted."""
        try:
            values = list(values)
        except TypeError:
            record_failure("invalid", n, f"returned {type(values).__name__}, not a list of {n} values")
            return [0.0] * n
        if len(values) != n:
            record_failure("invalid", n, f"returned {len(values)} values for {n} completions")
            return [0.0] * n
        out = []
        for v in values:
            if v is None:
                out.append(None)
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                record_failure("invalid", 1, f"returned {type(v).__name__} {v!r:.60}, not a number")
                v = 0.0
            if not math.isfinite(v):
                record_failure("invalid", 1, f"returned {v}")
                v = 0.0
            out.append(v)
        return out


def build_reward(name: str, options: Mapping | None = None, log_name: str | None = None,
                 timeout: float | None = None) -> SafeReward:
    """One reward, wrapped. `options` must name keyword-only parameters of the function; those without a
    default are required. `log_name` replaces the name TRL logs it under (default: `name`, or the function's
    name for "module:function")."""
    func = get_reward(name)
    options = dict(options or {})
    params = inspect.signature(func).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise TypeError(f"reward {name!r}: its function must take **kwargs: TRL passes every dataset column and "
                        "trainer_state by keyword (see rewards/registry.py)")
    allowed = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    required = {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    unknown = sorted(set(options) - allowed)
    if unknown:
        hint = _did_you_mean(unknown[0], sorted(allowed)) if len(unknown) == 1 else ""
        raise ValueError(f"reward {name!r}: unknown option(s) {', '.join(unknown)}{hint}; "
                         f"options: {', '.join(sorted(allowed)) or 'none'}")
    missing = sorted(required - set(options))
    if missing:
        raise ValueError(f"reward {name!r}: missing required option(s) {', '.join(missing)}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"reward {name!r}: timeout must be a positive number of seconds, got {timeout!r}")
    return SafeReward(func, log_name or (func.__name__ if ":" in name else name), options, timeout)


SPEC_KEYS = ("name", "weight", "kwargs", "log_name", "timeout")


def build_rewards(specs, failure_limit: FailureLimit | None = None) -> tuple[list[SafeReward], list[float]]:
    """Rewards and weights from a config list, for TRL: `GRPOTrainer(reward_funcs=funcs)` and
    `GRPOConfig(reward_weights=weights)`. TRL sums weight * reward per completion (a None reward is left out).

    Each spec is a reward name, a mapping {name, weight=1.0, kwargs={}, log_name=None, timeout=None}, or an
    object with those attributes (the pipeline's RewardSpec). `timeout` (seconds per batch) runs the reward in
    a worker process that is killed if it hangs, which scores the batch 0 and counts it. `failure_limit` stops
    training when a reward keeps failing (FailureLimit).
    """
    funcs, weights = [], []
    for i, spec in enumerate(specs):
        if isinstance(spec, str):
            spec = {"name": spec}
        elif not isinstance(spec, Mapping):
            spec = {k: getattr(spec, k) for k in SPEC_KEYS if hasattr(spec, k)}
        unknown = sorted(set(spec) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"rewards[{i}]: unknown key(s) {', '.join(unknown)}; keys: {', '.join(SPEC_KEYS)}")
        if not isinstance(spec.get("name"), str):
            raise ValueError(f"rewards[{i}]: 'name' must be a reward name or 'package.module:function'")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"rewards[{i}] ({spec['name']}): 'weight' must be a finite number, got {weight!r}")
        try:
            func = build_reward(spec["name"], spec.get("kwargs"), spec.get("log_name"), spec.get("timeout"))
        except (KeyError, ValueError, ImportError, AttributeError, TypeError) as e:
            raise ValueError(f"rewards[{i}]: {e}") from e
        if func.__name__ in [f.__name__ for f in funcs]:
            raise ValueError(f"rewards[{i}]: two rewards would be logged as {func.__name__!r}; give one a "
                             "'log_name'")
        func.failure_limit = failure_limit
        funcs.append(func)
        weights.append(float(weight))
    return funcs, weights
