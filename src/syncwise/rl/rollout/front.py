"""The rollout's front: ``samples_per_prompt`` responses per prompt from the current policy, by the engine
``rl.rollout_engine`` names, returned as a right-padded training batch -- prompt tokens, then the response up
to and including its end token, with ``loss_mask`` on the tokens the policy drew -- and a typed
:class:`RolloutResult`.

The trainer talks to :class:`Rollout` only; :class:`Rollout` talks to a
:class:`~syncwise.rl.rollout.base.RolloutEngine` -- refresh its weights from the sharded policy, sample, say
what it holds -- built from a plain :class:`~syncwise.rl.rollout.base.RolloutSetup` (the engines are one entry
each in :data:`syncwise.config.rollout_engines.ROLLOUT_ENGINES`), and runs the turn loop
(:mod:`syncwise.rl.rollout.turns`) over it alike for every engine: the batch, and the sampler's log-probs
aligned with the trainer's targets. Scoring is the trainer's own phase.

Like verl's rollout worker, each rank refreshes its engine from the sharded training model before each step,
one unit at a time (one unit's memory, not the whole model's), then samples without any collective.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ...config import Config
from ...config.rollout_engines import ROLLOUT_ENGINES
from ...engine import Engine
from ...memory.accounting import resolve_budget
from ...models.moe import ROUTES
from ...runtime.distributed import DistInfo, local_tensor
from ..env.base import Environment, FunctionTools, close_all
from ..env.classes import ClassEpisode
from ..env.tasks import PromptSource
from .agent_loop import AgentLoop, AgentRun
from .base import RolloutEngine, RolloutSetup, Trajectory, sample_seed
from .partial import Group, PartialPool
from .routes import replays_routes
from .turns import TurnLoop, counts_tensor

TRUNCATION_NOTE = (
    "rl.top_k / rl.top_p / rl.min_p truncate the sampler's distribution, and the trainer's log-probs are of the "
    "full one: rollout/log_prob_diff and rl.loss.rollout_is use the sampler's log-probs of the drawn tokens under "
    "the untruncated distribution (the copies' own mismatch; the truncation's kept mass, rollout/kept_mass, is no "
    "policy change and is not weighted in); the gradient is the untruncated policy's at the truncated samples")


def make_rollout_engine(setup: RolloutSetup) -> RolloutEngine:
    """``rl.rollout_engine``'s engine for this rank, from its table entry (built alike on every rank)."""
    module, _, name = ROLLOUT_ENGINES[setup.rl.rollout_engine].loader.partition(":")
    return getattr(importlib.import_module(module), name)(setup)


def episodes_of(source: PromptSource) -> Callable[[dict[str, Any]], Environment] | None:
    """Each conversation's environment from its row: an instance of ``rl.environment``'s class (``rl.tools``'
    functions beside its methods), or the functions alone; None without either (single-turn)."""
    if source.environment is not None:
        return lambda row: ClassEpisode(source.environment, source.tools)
    if source.tools:
        functions = FunctionTools(source.tools)
        return lambda row: functions
    return None


def model_name(config: Config) -> str:
    """The name the endpoint serves the policy as (``model``): its folder's, or the preset's."""
    path = config.model.path
    return os.path.basename(os.path.normpath(path)) if path else config.model.preset


def least_training_bytes(engine: Engine, beside_bytes: int, tokens: int) -> int:
    """What this rank's training needs at the least beside a rollout engine: the policy's parameters and
    optimizer state, its sharded gradients, ``beside_bytes`` (the other models kept beside it) and the first
    step's activations (its safest setting: the fused head, one micro-batch of ``tokens``)."""
    grads = sum(local_tensor(p).numel() * p.element_size() for p in engine.model.parameters() if p.requires_grad)
    tuning = engine.governor.tuning
    activations = tuning.activation_bytes(tokens, True) if tuning is not None else 0
    return engine.resident_bytes() + grads + beside_bytes + activations


@dataclass
class RolloutResult:
    """One rollout step on this rank, per sample (``samples_per_prompt`` consecutive ones per prompt)."""

    batch: dict[str, torch.Tensor]  # input_ids, attention_mask, loss_mask: right-padded prompt + response
    trajectories: list[Trajectory]
    log_probs: torch.Tensor  # [B, T-1] the sampler's, aligned with the trainer's targets (untruncated; 0 elsewhere)
    kept_mass: torch.Tensor  # per sampled token, the mass its truncation kept (empty where the engine does not say)
    tool_s: float  # spent in the tools, between the turns
    tool_counts: torch.Tensor | None  # with tools: TOOL_COUNTS summed over the samples
    episodes: list[Environment] = field(default_factory=list)  # with tools, each sample's: open until closed
    # partial rollouts (queue.DECODE_FIELDS): tokens drawn this step, rows x longest per call, dropped, decode steps
    decode: dict[str, float] | None = None
    agent: AgentRun | None = None  # rl.agent: the runs whose segments the trajectories are

    @property
    def sample_of(self) -> list[int] | None:
        """rl.agent: which sample each trajectory (a segment) is; None: each trajectory is its own sample."""
        return self.agent.sample_of if self.agent is not None else None

    def close_episodes(self) -> None:
        """Every episode is over (scored, or failed): each closed, all of them even where one raises."""
        episodes, self.episodes = self.episodes, []
        close_all(episodes)

    @property
    def responses(self) -> list[Any]:
        """What the reward functions see: the text, or with tools each conversation's messages after the prompt."""
        return [t.messages if self.tool_counts is not None or (self.agent and t.messages) else t.text
                for t in self.trajectories]

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(t.tokens) for t in self.trajectories])  # every token after the prompt

    @property
    def clipped(self) -> torch.Tensor:
        return torch.tensor([not t.ended for t in self.trajectories])  # cut by the length limit


class Rollout:
    """This rank's rollout: the engine ``rl.rollout_engine`` names, and the training batch from its samples."""

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase, source: PromptSource, hf_config: Any,
                 info: DistInfo, end_ids: list[int] | None = None, training_bytes: int = 0,
                 weights: Callable[[], Iterator[dict[str, torch.Tensor]]] | None = None):
        """The engine for the network ``hf_config`` describes, on this rank (``info``), budgeted beside
        ``training_bytes`` of training; ``weights``: where a refresh reads the policy from (a rollout rank is
        given them instead, see :mod:`syncwise.rl.rollout.ranks`)."""
        self.config, self.cfg, self.info, self.tokenizer, self.weights = config, config.rl, info, tokenizer, weights
        # Every token that ends a response: the tokenizer's end token and the model's generation_config's
        self.end_ids = sorted(set(end_ids or []) | {tokenizer.eos_token_id})
        self.max_new_tokens = self.cfg.max_new_tokens or source.max_new_tokens
        if self.cfg.truncates and info.is_main:
            warnings.warn(TRUNCATION_NOTE, stacklevel=2)
        device = info.device
        self.replays_routes, self.replay_obstacle = replays_routes(config, hf_config)
        self.sampler = make_rollout_engine(RolloutSetup(
            hf_config, device, self.cfg, tokenizer, self.end_ids, self.max_new_tokens, config.train.seed,
            resolve_budget(config.sync.memory_budget, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
            training_bytes, record_routes=self.replays_routes))
        self.turns = TurnLoop(self.cfg, tokenizer, self.end_ids, episodes_of(source), list(source.all_tools),
                              source.environment.name if source.environment else None)
        self.agents = (AgentLoop(self.cfg, tokenizer, self.end_ids, model_name(config),
                                 getattr(hf_config, "max_position_embeddings", None) or 2**31)
                       if self.cfg.agent else None)

    @classmethod
    def beside(cls, config: Config, engine: Engine, tokenizer: PreTrainedTokenizerBase, source: PromptSource,
               end_ids: list[int] | None = None, beside_bytes: int = 0) -> Rollout:
        """The colocated rollout: on the training rank, beside ``engine`` (and ``beside_bytes`` of other models),
        refreshed from it."""
        hf_config = engine.features.plain_hf_config
        longest = min(config.rl.max_prompt_length + (config.rl.max_new_tokens or source.max_new_tokens),
                      getattr(hf_config, "max_position_embeddings", None) or 2**31)
        return cls(config, tokenizer, source, hf_config, engine.info, end_ids,
                   least_training_bytes(engine, beside_bytes, longest), engine.full_weights_by_unit)

    @property
    def held_bytes(self) -> int:
        """What the rollout engine holds for the whole job on this rank."""
        return self.sampler.held_bytes()

    def describe(self) -> str:
        loop = self.agents.describe() if self.agents is not None else self.turns.describe()
        replay = ("; a mixture of experts, trained through the experts its sampler chose (rl.router_replay)"
                  if self.replays_routes else f"; router replay off: {self.replay_obstacle}"
                  if self.replay_obstacle else "")
        return self.sampler.describe() + (f", {loop}" if loop else "") + replay

    def close(self) -> None:
        """The job is over: what the rollout holds open beside the engine (the agents' endpoint) let go."""
        if self.agents is not None:
            self.agents.close()

    @torch.no_grad()
    def sync_weights(self, units: Iterator[dict[str, torch.Tensor]] | None = None) -> None:
        """Collective: the rollout engine refreshed from the current (sharded) policy, one unit at a time
        (LoRA: merged weights) -- or from ``units``, the weights a rollout rank receives."""
        self.sampler.refresh(units if units is not None else self.weights())

    @torch.no_grad()
    def generate(self, rows: list[dict[str, Any]], prompt_ids: list[list[int]], step: int = 0,
                 tool_schemas: list | None = None, release: bool = True, version: int | None = None,
                 seat: tuple[int, int] | None = None) -> RolloutResult:
        """``samples_per_prompt`` samples per row (its prompt already encoded: ``prompt_ids``; with tools,
        conversations, the rows' tools shown as ``tool_schemas``) at ``step``. Samples of one prompt are
        consecutive (the GRPO group). ``release``: the last rollout before the update (an off-policy job draws
        several on one refresh), after which the engine may free what the update does not need; ``version``: the
        policy's (RL steps taken; ``step`` where not given); ``seat``: (rank, world size) of the trainer these
        samples are for, whose seeds they take (this rank's where not given; a rollout rank serves others)."""
        n = self.cfg.samples_per_prompt
        rank, world = seat or (self.info.rank, self.info.world_size)
        if self.agents is not None:
            run = self.agents.run(self.sampler, rows, prompt_ids, n, self.max_new_tokens,
                                  (self.config.train.seed, step, rank, world), step if version is None else version)
            return self._finish(RolloutResult({}, run.trajectories, torch.zeros(0), torch.zeros(0), 0.0, None,
                                              agent=run), release)
        seeds = [sample_seed(self.config.train.seed, step, rank, world, turn, self.turns.max_turns,
                             len(prompt_ids) * n) for turn in range(self.turns.max_turns)]
        trajectories, tool_s, episodes = self.turns.run(self.sampler, rows, prompt_ids,
                                                        tool_schemas or [None] * len(rows), n, self.max_new_tokens,
                                                        seeds, step if version is None else version)
        result = RolloutResult({}, trajectories, torch.zeros(0), torch.zeros(0), tool_s,
                               counts_tensor(trajectories) if self.turns.multi_turn else None, episodes)
        return self._finish(result, release)

    @torch.no_grad()
    def generate_partial(self, pool: PartialPool, step: int, prompt_of: Callable[[int], list[int]],
                         version_now: Callable[[], int] | None = None, seat: tuple[int, int] | None = None
                         ) -> tuple[RolloutResult, list[Group]]:
        """Partial rollouts (``rl.max_staleness``): the pool's rounds until step ``step``'s groups have
        finished; those groups' samples (multi-turn: with their episodes, open until scored), and the groups (for
        their rows). Colocated each round is by the current policy (version ``step``) and the engine may sleep
        after; on a rollout rank (``version_now``: the newest policy received, asked before each round) it stays
        awake. ``seat`` as for :meth:`generate`."""
        rank, world = seat or (self.info.rank, self.info.world_size)
        fill = pool.fill(self.sampler, step, prompt_of, lambda round_: sample_seed(
            self.config.train.seed, step, rank, world, round_, pool.max_rounds, pool.capacity * pool.n),
            version_now)
        trajectories = [t for group in fill.groups for t in group.trajectories]
        result = RolloutResult({}, trajectories, torch.zeros(0), torch.zeros(0), fill.tool_s,
                               counts_tensor(trajectories) if self.turns.multi_turn else None,
                               [e for group in fill.groups for e in group.episodes or []],
                               decode={"drawn_tokens": float(fill.drawn_tokens), "lockstep": float(fill.lockstep),
                                       "dropped": float(fill.dropped), "decode_steps": float(fill.decode_steps)})
        return self._finish(result, release=version_now is None), fill.groups

    def _finish(self, result: RolloutResult, release: bool) -> RolloutResult:
        """The result's training batch, after the engine is released (``release``: every turn sampled, it may
        free what the update does not need); its episodes closed where that fails."""
        try:
            if release:
                self.sampler.release()
            self._batch(result)
        except BaseException:
            with contextlib.suppress(Exception):
                result.close_episodes()
            raise
        return result

    def _batch(self, result: RolloutResult) -> None:
        """The training batch of the result's samples, the sampler's log-probs aligned with its targets, and
        what truncation kept -- each built as one tensor from the samples' lists (a step's hundreds of rows:
        per-row tensors were most of a small job's rollout)."""
        trajectories = result.trajectories
        prompts = [len(t.prompt) for t in trajectories]
        lengths = torch.tensor([p + len(t.tokens) for p, t in zip(prompts, trajectories, strict=True)])
        width = int(lengths.max())
        real = torch.arange(width)[None, :] < lengths[:, None]  # right-padded: row-major order is the rows'
        ids = torch.full((len(trajectories), width), self.tokenizer.pad_token_id, dtype=torch.long)
        ids[real] = torch.tensor([x for t in trajectories for x in (*t.prompt, *t.tokens)], dtype=torch.long)
        sampled = torch.tensor([x for t in trajectories for x in t.sampled], dtype=torch.long)
        trained = torch.tensor([int(t.ended or not self.cfg.mask_truncated) for t in trajectories])
        responses = torch.tensor([len(t.tokens) for t in trajectories])
        is_response = torch.repeat_interleave(torch.tensor([[0, 1]] * len(trajectories)).flatten(),
                                              torch.stack([torch.tensor(prompts), responses], 1).flatten())
        loss_mask = torch.zeros_like(ids)
        loss_mask[real] = torch.zeros(int(lengths.sum()), dtype=torch.long).masked_scatter(
            is_response.bool(), sampled * trained.repeat_interleave(responses))
        full = torch.tensor([x for t in trajectories for x in t.full_log_probs], dtype=torch.float32)
        # Per target (position j predicts token j + 1): the response tokens' sampler log-probs.
        log_probs = torch.zeros((len(trajectories), width - 1), dtype=torch.float32)
        targets = torch.arange(width - 1)[None, :] < (lengths - 1)[:, None]
        log_probs[targets] = torch.zeros(int(lengths.sum()) - len(trajectories), dtype=torch.float32).masked_scatter(
            is_response[_without_firsts(lengths)].bool(), full * sampled)
        drawn_known = all(t.drawn_log_probs is not None for t in trajectories)
        # with truncation, how much of the full distribution's mass each drawn token's step kept
        kept_mass = ((full - torch.tensor([x for t in trajectories for x in t.drawn_log_probs], dtype=torch.float32)
                      ).exp()[sampled.bool()] if drawn_known else torch.zeros(0))
        result.batch = {"input_ids": ids, "attention_mask": real.long(), "loss_mask": loss_mask}
        if getattr(trajectories[0], "routes", None) is not None:  # the experts each token went through, to replay
            routes = torch.full((*ids.shape, *trajectories[0].routes.shape[1:]), -1, dtype=torch.int16)
            routes[real] = torch.cat([_routes_of(t) for t in trajectories])
            result.batch[ROUTES] = routes
        result.log_probs = log_probs
        result.kept_mass = kept_mass.double()


def _routes_of(trajectory: Trajectory) -> torch.Tensor:
    """A trajectory's sampled routes, one row per token of its prompt and after (-1 where none were recorded:
    a token the template added after the sampled ones)."""
    routes, length = trajectory.routes, len(trajectory.prompt) + len(trajectory.tokens)
    if len(routes) < length:
        routes = torch.cat([routes, routes.new_full((length - len(routes), *routes.shape[1:]), -1)])
    return routes[:length]


def _without_firsts(lengths: torch.Tensor) -> torch.Tensor:
    """Of the rows' tokens laid end to end, all but each row's first (what the targets are: token j + 1)."""
    keep = torch.ones(int(lengths.sum()), dtype=torch.bool)
    keep[torch.cumsum(lengths, 0) - lengths] = False
    return keep


def response_batch(sequences: list[torch.Tensor], response_masks: list[torch.Tensor], pad_id: int) -> dict:
    """A right-padded training batch of prompt + response sequences, ``loss_mask`` on the responses."""
    width = max(len(s) for s in sequences)
    return {
        "input_ids": right_pad(sequences, width, pad_id),
        "attention_mask": right_pad([torch.ones_like(s) for s in sequences], width, 0),
        "loss_mask": right_pad(response_masks, width, 0),
    }


def right_pad(rows: list[torch.Tensor], width: int, value: int) -> torch.Tensor:
    """Stack 1-D tensors, each right-padded with ``value`` to ``width``."""
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=value) for r in rows])
