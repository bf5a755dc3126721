"""A rollout rank's job (``dist.rollout_ranks``): sample, score and hand over, never train.

Rollout rank i serves trainers r with r mod M = i. For each message trainer 0 sends (see
:mod:`syncwise.rl.rollout.channel`) it loads the weights into its engine as they arrive, then draws each served
trainer's batches of the steps named, by that version -- the prompts, seeds and scoring the trainer's own
colocated queue would have used (:meth:`~syncwise.rl.batches.ScoredBatches.draw`, seated as that trainer), so a
job with rollout ranks trains on exactly the batches the colocated job with the same ``rl.off_policy_lag`` does --
and posts them. While the trainers train step t on the batch drawn by version t - k, it draws step t + k's by
version t: sampling and training overlap. It ends when the trainers do (they say so); a stop signal is theirs
to act on at a step boundary, and they still need the batches they checkpoint.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import torch
from transformers import CONFIG_MAPPING

from ..config import Config
from ..runtime.distributed import DistInfo
from ..runtime.roles import JobRoles
from .batches import ScoredBatches
from .env.tasks import end_token_ids, load_tokenizer, prompt_source
from .rollout.channel import RolloutChannel
from .rollout.front import Rollout
from .stats import PhaseClock

HF_CONFIG_KEY = "rollout_ranks/hf_config"  # trainer 0 posts the plain network's config: what the engine builds


def share_network(roles: JobRoles, hf_config) -> None:
    """Trainer 0: the config of the network the weights fit (LoRA merged: the plain model's), for the rollout
    ranks to build their engine from."""
    if roles.job_rank == 0:
        roles.store.set(HF_CONFIG_KEY, hf_config.to_json_string())


def rollout_ranks_line(config: Config, trainers: int) -> str:
    """The trainers' first line's words for the rollouts."""
    last = trainers + config.dist.rollout_ranks - 1
    return (f"rollouts by {config.dist.rollout_ranks} rollout rank(s) of their own (ranks {trainers}-{last}, "
            f"{config.rl.rollout_engine}; weights from trainer 0 after each step)")


def run_rollout_rank(config: Config, info: DistInfo, roles: JobRoles) -> None:
    """Serve the trainers until they end."""
    rl = config.rl
    tokenizer = load_tokenizer(config)
    source = prompt_source(rl.task, rl.dataset, rl.reward_fn, rl.reward_weights, rl.tools, rl.environment)
    source.encode(tokenizer, rl)
    fields = json.loads(roles.store.get(HF_CONFIG_KEY).decode())
    hf_config = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
    rollout = Rollout(config, tokenizer, source, hf_config, info, end_token_ids(config.model.path))
    channel = RolloutChannel(roles, info.device, config.dist.timeout_s)
    served = {r: ScoredBatches(config, replace(info, rank=r, world_size=roles.trainers), rollout, source)
              for r in roles.served_by(roles.rollout_index)}
    number = 0
    while True:
        waited = time.perf_counter()
        draw = channel.next_draw(number)
        if draw is None:
            return
        received = time.perf_counter()
        rollout.sync_weights(channel.receive_weights(number))
        idle_s, weights_s = received - waited, time.perf_counter() - received
        for step in draw.steps:
            for trainer, batches in served.items():
                clock = PhaseClock()
                scored = batches.draw(step, draw.version, clock, last=step == draw.steps[-1])
                first = step == draw.steps[0]
                scored.rollout_rank_s = torch.tensor(
                    [clock.seconds["rollout"] + clock.seconds["tools"], clock.seconds["reward"],
                     idle_s if first else 0.0, weights_s if first else 0.0], dtype=torch.float64)
                channel.post(step, trainer, scored)
        number += 1
