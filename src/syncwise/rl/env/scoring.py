"""Reward functions as ``rl.reward_fn`` names them, and scoring a rollout's responses with them.

A path is ``package.module:function`` (imported as ``python -m`` would, with the job's folder first on the
path) or ``path/to/file.py:function``. Three signatures, read from the function's parameters before any rank
starts:

- **TRL's** (a parameter named ``completions`` or ``completion_ids``, or ``**kwargs`` where the other two do not
  fit), called as TRL's ``GRPOTrainer`` calls its
  ``reward_funcs``: by keyword, ``prompts`` (as the dataset has them, an environment's opening appended),
  ``completions`` (strings for string prompts; for conversational prompts ``[{"role": "assistant", "content":
  ...}]``, with tools the whole conversation after the prompt), ``completion_ids``, ``trainer_state``
  (``global_step``, ``max_steps``), every dataset column but ``prompt`` by its name (one entry per completion),
  ``log_extra`` (a column of the completions table) and ``log_metric`` (a number logged with the step's metrics),
  and with ``rl.environment`` ``environments`` (the user's own instances); it returns one number per completion,
  or ``None`` where it does not apply;
- per-sample, ``fn(prompt, response, row) -> float``;
- batched, ``fn(prompts, responses, rows) -> list[float]`` -- declared with ``@syncwise.rewards.batched`` or by
  naming its first parameter ``prompts``.

With ``rl.environment``, a per-sample function with an ``env`` parameter is given the sample's instance of the
user's class, a batched one with an ``environments`` parameter the list of them (TRL's name). Several functions
are summed with ``rl.reward_weights`` (TRL's ``reward_weights``); a ``None`` adds nothing to a sample's total
(TRL's ``nansum``) and is left out of its function's mean, ``reward/<name>``, logged beside the weighted total;
samples that no function scored are counted (``reward/all_none_fraction``). An episode's own ``get_reward()`` is
one more part, at weight 1, logged under its class's name. Reward functions are your code and run with the job's
rights.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .loader import load_function
from .threads import OwnThread

TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "environments", "log_extra",
                 "log_metric")


@dataclass
class RewardLogs:
    """What TRL-signature functions logged while scoring a batch: ``log_extra(column, values)`` -- one value per
    completion, a column of the completions table -- and ``log_metric(name, value)`` -- a number, averaged over the
    step's calls on every rank, logged as ``name``."""

    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: list[dict[str, float]] = field(default_factory=list)
    size: int = 0  # completions in the batch

    def log_extra(self, column: str, values: list[Any]) -> None:
        values = list(values)
        if len(values) != self.size:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {self.size} completions")
        self.extra[str(column)] = [_plain(v) for v in values]

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.append({str(name): float(value)})


def _plain(value: Any) -> Any:
    """A logged value as the table keeps it: a number, a string or None (anything else as its text)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


@dataclass
class RewardState:
    """What TRL's ``trainer_state`` gives a reward function for shaping over training (``global_step``: the steps
    taken before this one's rollout)."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class RewardFunction:
    name: str  # as logged: reward/<name>
    label: str  # how an error names it: rl.reward_fn (one function) or rl.reward_fn <path> (several)
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False
    parameters: frozenset = field(init=False)  # its parameters' names: whether it asks for env / environments
    trl: bool = field(init=False)  # TRL's signature: everything by keyword, one call per batch
    any_keyword: bool = field(init=False)  # takes **kwargs: every dataset column reaches it

    def __post_init__(self) -> None:
        self.parameters = frozenset(_parameters(self.fn))
        self.any_keyword = _takes_any_keyword(self.fn)
        # TRL's: it names completions, or takes keywords only (reward_func(environments, **kwargs))
        self.trl = bool({"completions", "completion_ids"} & self.parameters) or (
            self.any_keyword and not _takes_three(self.fn))

    def columns(self) -> list[str]:
        """The dataset columns it needs by name: a TRL function's required parameters that TRL does not pass
        itself; a built-in reward's (``syncwise_columns``)."""
        own = list(getattr(self.fn, "syncwise_columns", ()))
        if not self.trl:
            return own
        return own + [name for name, p in _signature(self.fn).items() if name not in TRL_ARGUMENTS
                      and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def check(self, columns: set[str], where: str) -> None:
        """A ValueError in one line where the function fits no signature, or needs a column ``where`` lacks."""
        if not self.trl and not self.batched and not _takes_three(self.fn):
            raise ValueError(f"{self.label}: {self.name}({', '.join(_parameters(self.fn))}) fits no reward "
                             "signature: TRL's (completions, **kwargs) -- prompts, completion_ids, trainer_state and "
                             "the dataset's columns by name -- or syncwise's fn(prompt, response, row) / "
                             "fn(prompts, responses, rows)")
        missing = [c for c in self.columns() if c not in columns]
        if missing:
            raise ValueError(f"{self.label}: {self.name} reads the column(s) {', '.join(missing)}, which {where} "
                             f"does not have (its columns: {', '.join(sorted(columns))})")


def load_reward_fn(path: str) -> Callable[..., Any]:
    """The reward function ``path`` names; a ValueError naming ``rl.reward_fn`` if it cannot be had."""
    return load_function(path, "rl.reward_fn")


def _signature(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return {}


def _parameters(fn: Callable[..., Any]) -> list[str]:
    """``fn``'s parameters' names, in order (none for a builtin without a signature)."""
    return [name for name, p in _signature(fn).items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _takes_any_keyword(fn: Callable[..., Any]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in _signature(fn).values())


def _takes_three(fn: Callable[..., Any]) -> bool:
    """Whether ``fn(prompt, response, row)`` binds (a builtin without a signature is given the benefit)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(None, None, None)
    except TypeError:
        return False
    return True


def is_batched(fn: Callable[..., Any]) -> bool:
    """Declared batched (``@syncwise.rewards.batched``), or its first parameter is named ``prompts``."""
    if getattr(fn, "syncwise_batched", False):
        return True
    params = _parameters(fn)  # a builtin without a signature: per-sample
    return bool(params) and params[0] == "prompts"


def reward_functions(paths: list[str], weights: list[float]) -> list[RewardFunction]:
    """The functions of ``rl.reward_fn`` with their weights (1 each when none are given) and unique names."""
    out: list[RewardFunction] = []
    for i, path in enumerate(paths):
        fn = load_reward_fn(path)
        name = path.rpartition(":")[2]
        if any(r.name == name for r in out):
            name = f"{name}_{i}"
        label = "rl.reward_fn" if len(paths) == 1 else f"rl.reward_fn {path}"
        out.append(RewardFunction(name, label, fn, weights[i] if weights else 1.0, is_batched(fn)))
    return out


def score(functions: list[RewardFunction], prompts: list[Any], responses: list[Any], rows: list[dict[str, Any]],
          environments: list[Any] | None = None, completion_ids: list[list[int]] | None = None,
          state: RewardState | None = None, trl_environments: bool = False, logs: RewardLogs | None = None
          ) -> tuple[list[float], dict[str, list[float]]]:
    """Every response's weighted total and each function's own rewards (NaN where it gave ``None``;
    ``environments``: each sample's instance of the user's class, or its episode, for the functions that ask for
    it -- a TRL function gets them with ``trl_environments``). A function that raises, returns the wrong number
    of rewards or a non-finite one is a ValueError naming it (and, per sample, the prompt); ``logs``: where TRL's
    ``log_extra`` / ``log_metric`` write. An ``async def`` function is awaited, every async call of the batch side
    by side on one event loop kept for the job (TRL's: a client an async function keeps stays usable), the others
    called in this thread, in order."""
    logs = logs if logs is not None else RewardLogs()
    logs.size = len(responses)
    envs = environments if environments is not None else [None] * len(responses)
    returned: dict[str, Any] = {}  # each function's value (per-sample: a list of them), coroutines not yet awaited
    for reward in functions:
        wants = reward.parameters
        if reward.trl:
            returned[reward.name] = _call(reward, None, reward.fn, **_trl_arguments(
                reward, prompts, responses, rows, completion_ids, state,
                environments if trl_environments else None, logs))
        elif reward.batched:
            extra = {"environments": environments} if "environments" in wants and environments else {}
            returned[reward.name] = _call(reward, None, reward.fn, prompts, responses, rows, **extra)
        else:
            returned[reward.name] = [
                _call(reward, (p, r), reward.fn, p, r, row, **({"env": env} if "env" in wants and env is not None
                                                               else {}))
                for p, r, row, env in zip(prompts, responses, rows, envs, strict=True)]
    returned = _awaited(returned, functions, prompts, responses)
    parts: dict[str, list[float]] = {}
    for reward in functions:
        if reward.trl or reward.batched:
            parts[reward.name] = _rewards(reward, returned[reward.name], len(responses))
        else:
            parts[reward.name] = [_number(reward.label, value, lambda p=p, r=r: f" (prompt {p!r}, response {r!r})")
                                  for value, p, r in zip(returned[reward.name], prompts, responses, strict=True)]
    totals = [sum(r.weight * parts[r.name][i] for r in functions if not math.isnan(parts[r.name][i]))
              for i in range(len(responses))]
    return totals, parts


def score_samples(functions: list[RewardFunction], rows: list[dict[str, Any]], responses: list[Any], n: int,
                  environments: list[Any] | None = None, episode_rewards: list[float | None] = (),
                  episode_name: str = "environment", completion_ids: list[list[int]] | None = None,
                  prompts: list[Any] | None = None, state: RewardState | None = None,
                  trl_environments: bool = False, logs: RewardLogs | None = None
                  ) -> tuple[list[float], dict[str, list[float]]]:
    """:func:`score` for a rollout step's samples, ``n`` consecutive ones per row (``prompts``: each sample's as
    its episode opened it, else its row's); an episode's own score (its environment's ``reward()``, where it gives
    one) is one more part, ``episode_name``, added to the total."""
    group_rows = [rows[i // n] for i in range(len(responses))]
    prompts = prompts if prompts is not None else [row["prompt"] for row in group_rows]
    totals, parts = score(functions, prompts, responses, group_rows, environments, completion_ids, state,
                          trl_environments, logs)
    if any(r is not None for r in episode_rewards):
        parts[episode_name] = [r or 0.0 for r in episode_rewards]
        totals = [total + r for total, r in zip(totals, parts[episode_name], strict=True)]
    return totals, parts


def _trl_arguments(reward: RewardFunction, prompts: list[Any], responses: list[Any], rows: list[dict[str, Any]],
                   completion_ids: list[list[int]] | None, state: RewardState | None,
                   environments: list[Any] | None, logs: RewardLogs) -> dict[str, Any]:
    """A TRL reward function's keywords as TRL's ``_calculate_rewards`` gives them (what it cannot take left out
    where it has no ``**kwargs``)."""
    completions = [[{"role": "assistant", "content": r}] if isinstance(p, list) and isinstance(r, str) else r
                   for p, r in zip(prompts, responses, strict=True)]
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"} if rows else {}
    given = {**columns, "prompts": prompts, "completions": completions,
             "completion_ids": completion_ids if completion_ids is not None else [[] for _ in responses],
             "trainer_state": state or RewardState(), "log_extra": logs.log_extra, "log_metric": logs.log_metric}
    if environments is not None:
        given["environments"] = environments
    if not reward.any_keyword:
        given = {k: v for k, v in given.items() if k in reward.parameters}
    return given


def _raised(reward: RewardFunction, exc: BaseException, sample: tuple[Any, Any] | None) -> ValueError:
    """What a function that raised (called, or awaited) is said as: per sample, with its prompt and response."""
    if reward.trl:
        return ValueError(f"{reward.label}: {reward.name} raised {type(exc).__name__}: {exc}")
    if reward.batched:
        return ValueError(f"{reward.label} (batched): raised {type(exc).__name__}: {exc}")
    prompt, response = sample
    return ValueError(f"{reward.label}: raised {type(exc).__name__}: {exc} (prompt {prompt!r}, response "
                      f"{response!r})")


def _call(reward: RewardFunction, sample: tuple[Any, Any] | None, fn: Callable[..., Any], *args: Any,
          **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # user code: any exception
        raise _raised(reward, exc, sample) from exc


_ASYNC_REWARDS = OwnThread("syncwise-async-rewards")  # one event loop for the job's async reward functions


async def _gather(awaitables: list[Any]) -> list[Any]:
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _awaited(returned: dict[str, Any], functions: list[RewardFunction], prompts: list[Any],
             responses: list[Any]) -> dict[str, Any]:
    """``returned`` with every coroutine in it awaited, all side by side; the first that raised is its ValueError."""
    places = []  # (the function, its sample or None: one value for the batch)
    for reward in functions:
        value = returned[reward.name]
        if reward.trl or reward.batched:
            places += [(reward, None)] if inspect.isawaitable(value) else []
        else:
            places += [(reward, i) for i, v in enumerate(value) if inspect.isawaitable(v)]
    if not places:
        return returned
    awaitables = [returned[r.name] if i is None else returned[r.name][i] for r, i in places]
    values = _ASYNC_REWARDS.call(_gather, awaitables)
    out = {name: list(value) if isinstance(value, list) else value for name, value in returned.items()}
    for (reward, i), value in zip(places, values, strict=True):
        if isinstance(value, BaseException):
            raise _raised(reward, value, None if i is None else (prompts[i], responses[i])) from value
        if i is None:
            out[reward.name] = value
        else:
            out[reward.name][i] = value
    return out


def _rewards(reward: RewardFunction, values: Any, completions: int) -> list[float]:
    """A TRL or batched function's list of rewards, checked: a list (not a string, which would be read character
    by character), one reward per completion, each a finite number or None."""
    who, each = (f"{reward.label}: {reward.name}", "completion") if reward.trl else (f"{reward.label} (batched)",
                                                                                  "response")
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{who}: returned {values!r}, not a list of rewards (one number or None per {each})")
    values = list(values)
    if len(values) != completions:
        raise ValueError(f"{who}: returned {len(values)} rewards for {completions} {each}s")
    return [_number(who, v) for v in values]


def checked_reward(value: Any, returned: str, none: str, where: str | Callable[[], str] = "") -> float | None:
    """A reward the user's code returned (a reward function, an environment's ``get_reward``, an agent): None as
    None, else a finite float; else a ValueError "``returned`` <value>``where``, not a number (``none``)" --
    ``where`` made only then where it is a function (a sample's prompt and response: their repr for every sample
    doubled the reward phase)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{returned} {value!r}{_said(where)}, not a number ({none})") from exc
    if not math.isfinite(number):
        raise ValueError(f"{returned} {number}{_said(where)}; a reward must be a finite number ({none})")
    return number


def _said(where: str | Callable[[], str]) -> str:
    return where() if callable(where) else where


def _number(who: str, value: Any, where: str | Callable[[], str] = "") -> float:
    """A function's reward as a float: NaN for None (no reward from it for that sample), else a finite number
    (``who`` returned it; ``where``: for which sample)."""
    number = checked_reward(value, f"{who}: returned", "None: no reward from it for that sample", where)
    return math.nan if number is None else number
