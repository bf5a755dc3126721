"""The table of rollout modes: where each RL step's scored batch comes from, the way
:mod:`syncwise.sync.modes` is the table of sync modes. Torch-free; resolved once from the config
(:func:`resolve_rollout_mode`, at validation), with every rule across ``rl.off_policy_lag``, ``rl.max_staleness``
and ``dist.rollout_ranks`` and its message here. Each mode is one producer of scored batches
(:mod:`syncwise.rl.batches`), its checkpoint state its own.

=================================  ========================  =====================  ============================
mode (keys)                        who samples               which policy           a checkpoint keeps
=================================  ========================  =====================  ============================
``synchronous`` (neither)          this rank, each step      the step's             nothing
``lag`` (off_policy_lag=k)         this rank, k steps ahead  step t - k's           the k batches drawn ahead
``partial`` (max_staleness=s)      this rank, in rounds      t - s .. t, per token  the conversations in flight
``lag_on_rollout_ranks``           rollout ranks             step t - k's           the batches asked for
``drawn_on_rollout_ranks``         rollout ranks, drawn on   t - s .. t, per token  posted batches + in flight
=================================  ========================  =====================  ============================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .checks import ConfigError

if TYPE_CHECKING:
    from .rl import RLConfig


@dataclass(frozen=True)
class RolloutMode:
    """One row of the table."""

    name: str
    on_rollout_ranks: bool  # sampled by ranks of their own (dist.rollout_ranks), fetched by the trainers
    partial: bool  # partial rollouts carried across steps (rl.max_staleness), else whole batches
    exact: bool  # a rerun trains on the same batches (no timing decides which policy draws what)
    words: str  # the mode in a few words (bench rows); {lag}: rl.off_policy_lag

    @property
    def off_policy(self) -> bool:
        return self.name != "synchronous"

    def label(self, lag: int) -> str:
        return self.words.format(lag=lag)


ROLLOUT_MODES: dict[str, RolloutMode] = {mode.name: mode for mode in (
    RolloutMode("synchronous", False, False, True, "synchronous"),
    RolloutMode("lag", False, False, True, "lag {lag}"),
    RolloutMode("partial", False, True, True, "partial rollouts"),
    RolloutMode("lag_on_rollout_ranks", True, False, True, "lag {lag}, rollout ranks"),
    RolloutMode("drawn_on_rollout_ranks", True, True, False, "partial rollouts, rollout ranks"),
)}


def resolve_rollout_mode(rl: RLConfig, rollout_ranks: int, steps: int) -> tuple[RolloutMode, int]:
    """The mode the keys name and ``rl.off_policy_lag`` resolved (unset: 1 with rollout ranks that draw whole
    batches -- one step off-policy, verl's and prime-rl's default: sampling overlaps training --, else 0); a
    combination that cannot run is a :class:`ConfigError` naming its keys."""
    lag, max_staleness = rl.off_policy_lag, rl.max_staleness
    if rl.partial_chunk_tokens and not max_staleness:
        raise ConfigError(f"rl.partial_chunk_tokens={rl.partial_chunk_tokens} is the round of a partial rollout: it "
                          "needs rl.max_staleness >= 1 (without it every response is drawn whole)")
    if max_staleness and lag:
        raise ConfigError("rl.max_staleness and rl.off_policy_lag: choose one -- partial rollouts with bounded "
                          "staleness, or whole batches drawn a fixed number of steps ahead")
    if lag is None:
        lag = 1 if rollout_ranks and not max_staleness else 0
    elif rollout_ranks and not (lag or max_staleness):
        raise ConfigError(f"dist.rollout_ranks={rollout_ranks} with rl.off_policy_lag=0: rollout ranks sample while "
                          "the trainers train, so every step trains on what an older policy drew; set "
                          "rl.off_policy_lag >= 1 (whole batches a fixed lag ahead) or rl.max_staleness >= 1 "
                          "(partial rollouts drawn on), or leave both unset for a lag of 1")
    if lag >= steps:
        raise ConfigError(f"rl.off_policy_lag={lag} with train.steps={steps}: every step would train on the initial "
                          "policy's samples; use a lag below train.steps")
    return mode_of(lag, max_staleness, rollout_ranks), lag


def mode_of(lag: int, max_staleness: int, rollout_ranks: int) -> RolloutMode:
    """The row that resolved keys name (:func:`resolve_rollout_mode` checks them first)."""
    if max_staleness:
        return ROLLOUT_MODES["drawn_on_rollout_ranks" if rollout_ranks else "partial"]
    if lag:
        return ROLLOUT_MODES["lag_on_rollout_ranks" if rollout_ranks else "lag"]
    return ROLLOUT_MODES["synchronous"]


@dataclass(frozen=True)
class StalenessBound:
    """``rl.max_staleness``: a step trains on samples drawn by policies at most ``versions`` behind it (AReaL's
    bound); each group is judged by the policy that drew its first tokens."""

    versions: int

    def oldest(self, step: int) -> int:
        """The oldest policy version that may draw (the first tokens of) what step ``step`` trains."""
        return max(step - self.versions, 0)

    def keeps(self, step: int, started: int) -> bool:
        """Whether a group started by version ``started`` may still train at step ``step``."""
        return step - started <= self.versions

    def steps_drawable(self, step: int, version: int) -> int:
        """How many steps' groups, from ``step`` on, the policy of ``version`` may start: those up to step
        ``version + versions`` (``versions + 1`` colocated, where the version is the step's)."""
        return version + self.versions - step + 1
