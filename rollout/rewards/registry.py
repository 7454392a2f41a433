"""Reward functions by name: the built-in verifiers, or any function given as "package.module:function".

The contract (sync or async):

    fn(sample, response: str, answer, **metadata) -> float | dict

- `sample`: the `slime_dsa.data.sample.Sample` being scored (prompt_text, task, ... ); verifiers that only read
  the text may ignore it, and it is None when a verifier is called outside the RL loop.
- `response`: the response text; `answer`: the ground truth (`sample.answer`); `metadata`: `sample.metadata`
  as keyword arguments. A function without `**kwargs` receives only the metadata keys it names.
- Returns the reward, or a dict with a "reward" key plus extra numeric metrics (logged per task).

Where a call runs (`RewardFunction.isolation`): async functions run on the plugin loop, an event loop in a helper
thread (rollout/plugin_loop.py). They must not block it (time.sleep, a busy loop, blocking I/O): one that does
stalls the async rewards running beside it until their deadlines, each scoring 0 as a timeout, and then its thread
is abandoned for a fresh loop; the rollout itself goes on. A sync function
given as "package.module:function" runs in a worker process that is killed and replaced if it passes its deadline
(it gets a copy of the sample, without `indexer_topk`; changes to it are not seen); the built-in pure-python
verifiers (arithmetic, countdown, sort: bounded work, microseconds) run inline; other callables run in threads.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rollout.rewards.arithmetic import arithmetic_reward
from rollout.rewards.countdown import countdown_reward
from rollout.rewards.math_verifier import math_verify_reward
from rollout.rewards.sort import sort_reward
from rollout.rewards.tool_answer import tool_answer_reward
from slime_dsa.config.errors import UserError


class RewardLoadError(UserError, ValueError):
    """A reward function spec could not be resolved; the message names the spec and what failed (one line)."""


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

Isolation = Literal["inline", "thread", "process"]  # where a sync function runs; "loop" marks an async one


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward function: its name (for logs), the callable, and how to call it."""

    name: str
    fn: Callable[..., Any]
    is_async: bool
    accepts_any_metadata: bool  # has **kwargs
    metadata_names: frozenset[str]  # keyword parameters it names, past the three positional ones
    isolation: Isolation | Literal["loop"] = "thread"  # where a call runs (module doc); "loop": async, the plugin loop
    spec: str | None = None  # the "package.module:function" path a worker process imports (isolation process)

    @classmethod
    def wrap(cls, fn: Callable[..., Any], name: str | None = None, isolation: Isolation = "thread",
             spec: str | None = None) -> RewardFunction:
        """Check that `fn` takes (sample, response, answer, ...) and record how to pass it metadata and where it runs.

        isolation process needs an import path a worker can follow (`spec`, else the function's module and name);
        without one (__main__, a function defined inside another) the function runs in a thread."""
        name = name or getattr(fn, "__qualname__", None) or repr(fn)
        if not callable(fn):
            raise RewardLoadError(f"reward function {name!r} is not callable (got {type(fn).__name__})")
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError) as exc:
            raise RewardLoadError(f"reward function {name!r}: cannot read its signature ({exc})") from exc
        positional = [p for p in params if p.kind in _POSITIONAL]
        has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        if len(positional) < 3 and not has_varargs:
            raise RewardLoadError(
                f"reward function {name!r} takes {len(positional)} positional parameter(s); a reward function "
                "takes (sample, response, answer, **metadata)")
        required_extra = [p.name for p in positional[3:] if p.default is inspect.Parameter.empty]
        if required_extra:
            raise RewardLoadError(f"reward function {name!r}: parameter {required_extra[0]!r} past (sample, "
                                  "response, answer) needs a default; metadata arrives as keyword arguments")
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        if isolation == "process":
            spec = spec or f"{getattr(fn, '__module__', '__main__')}:{getattr(fn, '__qualname__', '<none>')}"
            if spec.startswith("__main__:") or "<" in spec:
                isolation, spec = "thread", None
        return cls(
            name=name,
            fn=fn,
            is_async=is_async,
            isolation="loop" if is_async else isolation,
            spec=spec if isolation == "process" and not is_async else None,
            accepts_any_metadata=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params),
            metadata_names=frozenset(p.name for p in params[3:] if p.kind is not inspect.Parameter.VAR_KEYWORD
                                     and p.kind is not inspect.Parameter.VAR_POSITIONAL),
        )

    def metadata_kwargs(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """The metadata entries this function accepts as keyword arguments."""
        if self.accepts_any_metadata:
            return dict(metadata)
        return {k: v for k, v in metadata.items() if k in self.metadata_names}


# math_verify runs its checks in its own killable processes (math_verifier.py), so a thread always comes back.
_REGISTRY: dict[str, tuple[Callable[..., Any], Isolation]] = {
    "arithmetic": (arithmetic_reward, "inline"),
    "sort": (sort_reward, "inline"),
    "countdown": (countdown_reward, "inline"),
    "math_verify": (math_verify_reward, "thread"),
    "math": (math_verify_reward, "thread"),
    "tool_answer": (tool_answer_reward, "inline"),
}


def register_reward(name: str, fn: Callable[..., Any] | None = None, isolation: Isolation = "thread") -> Any:
    """Register `fn` under `name` (also usable as a decorator: `@register_reward("mine")`)."""
    if ":" in name:
        raise ValueError(f"reward name {name!r} must not contain ':' (that marks an import path)")
    if fn is None:
        return functools.partial(register_reward, name, isolation=isolation)
    RewardFunction.wrap(fn, name, isolation)  # fail at registration, not at the first sample
    _REGISTRY[name] = (fn, isolation)
    return fn


def available_rewards() -> list[str]:
    """Names of the registered reward functions."""
    return sorted(_REGISTRY)


def load_reward_fn(spec: str) -> RewardFunction:
    """Resolve a registered name or a "package.module:function" path (attribute paths like "mod:Cls.fn" too)."""
    if not isinstance(spec, str) or not spec:
        raise RewardLoadError(f"reward function must be a registered name or 'package.module:function', got {spec!r}")
    if ":" not in spec:
        if spec not in _REGISTRY:
            raise RewardLoadError(f"unknown reward function {spec!r}; registered: {', '.join(available_rewards())}; "
                                  "or give an import path 'package.module:function'")
        fn, isolation = _REGISTRY[spec]
        return RewardFunction.wrap(fn, spec, isolation)
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise RewardLoadError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # ImportError, any error the module raises, a script's sys.exit
        raise RewardLoadError(f"reward function {spec!r}: cannot import module {module_name!r} "
                              f"({type(exc).__name__}: {exc})") from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise RewardLoadError(f"reward function {spec!r}: {getattr(obj, '__name__', module_name)!r} "
                                  f"has no attribute {part!r}")
        obj = getattr(obj, part)
    return RewardFunction.wrap(obj, spec, "process", spec=spec)
