"""``syncwise train``: GRPO (and PPO with a critic, ``rl.algorithm=ppo``) end to end -- rollouts, rewards,
advantages, the actor update through the engine, checkpoints, logs, plots and a Hugging Face export.

:class:`RLTrainer` is one rank's job in four pieces: set-up (``__init__``), :meth:`~RLTrainer.step`,
:meth:`~RLTrainer.save` and :meth:`~RLTrainer.finish`; :meth:`~RLTrainer.run` strings them together.
Before the first step, optionally ``rl.warm_start_steps`` supervised steps on the task's answers. One step
on every rank::

    rows = prompts for (step, rank)          deterministic: a resumed run sees the same prompts
    rollout.sync_weights()                   one unit at a time (one unit's memory, not the model's)
    rollout.generate                         samples_per_prompt responses per prompt, local, no collectives
    rewards -> group advantages              GRPO / Dr.GRPO / RLOO within each prompt's group (not PPO)
    [skip uniform groups], balance ranks     samples move between ranks (rl.balance_ranks; same gradient)
    [ref log-probs], [old log-probs]         forward-only passes (a frozen reference with rl.loss.kl_coef or
                                             rl.kl_in_reward > 0; old ones only with several optimizer steps
                                             per batch or a KL in the reward)
    PPO: critic values -> GAE, whitened      syncwise.rl.algorithm.ppo (token rewards, advantages across ranks)
    PPO: critic.train_batch(value loss)      over the same mini-batches, before the actor's
    engine.train_batch(batch, policy loss)   micro-batched, sync mode from config (auto by default)
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointManager
from ..config import Config, config_to_dict
from ..engine import Engine
from ..engine.sequence_parallel import resolve_split
from ..export import export_hf
from ..logs import JobLogs, LogSettings
from ..metrics import job_history, plot_curves, plot_phases
from ..models import build_model
from ..models.lora import adapters_disabled
from ..models.moe import router_aux_coef
from ..runtime.distributed import DistInfo, init_distributed
from ..runtime.roles import JobRoles
from ..runtime.signals import stopped
from .algorithm.advantages import grpo_advantages, rloo_advantages
from .algorithm.balance import samples_that_train
from .algorithm.losses import make_policy_loss
from .algorithm.mini_batches import mini_batches
from .algorithm.ppo import Critic, ppo_advantages
from .batches import batch_producer
from .drawing import BatchDrawer
from .env.tasks import end_token_ids, load_tokenizer, prompt_source
from .evaluation import Evaluation, eval_row
from .job_log import first_line, print_summary
from .rollout.channel import RolloutChannel
from .rollout.front import Rollout
from .rollout_rank import rollout_ranks_line, share_network
from .stats import (
    PHASES,
    PhaseClock,
    combine_updates,
    drawn_tokens,
    progress_line,
    rollout_rank_metrics,
    rollout_stats,
    scoring_metrics,
    throughput,
)
from .transcripts import step_completions
from .warm_start import keep_changed_bases, start_from_policy, warm_start_step


class TrainingStopped(RuntimeError):
    """Training could not go on (e.g. too many non-finite steps in a row); a checkpoint was written."""


def advantages_for(rewards: torch.Tensor, config: Config) -> torch.Tensor:
    n = config.rl.samples_per_prompt
    if config.rl.advantage == "rloo":
        return rloo_advantages(rewards, n)
    return grpo_advantages(rewards, n, norm_by_std=config.rl.advantage == "grpo")


class RLTrainer:
    """One rank's GRPO or PPO job."""

    def __init__(self, config: Config, info: DistInfo, roles: JobRoles | None = None):
        """Set-up: tokenizer, prompts and reward, the actor engine (and a frozen reference for the KL),
        the rollout copy (``roles``: none, the job's rollout ranks sample), the loss, checkpoints (resuming if
        asked) and, on rank 0, the logs."""
        self.config, self.info = config, info
        train, rl = config.train, config.rl
        self.out_dir = Path(train.out_dir)
        torch.manual_seed(train.seed * 1000 + info.rank)
        random.seed(train.seed * 1000 + info.rank)
        self.tokenizer = load_tokenizer(config)
        self.source = prompt_source(rl.task, rl.dataset, rl.reward_fn, rl.reward_weights, rl.tools, rl.environment)
        self.source.encode(self.tokenizer, rl)
        overrides = {} if config.model.path else {"vocab_size": len(self.tokenizer)}
        updates_per_step = rl.mini_batches * rl.epochs
        # Dropout off unless kept: the ratio, old log-probs and KL must see the sampler's network (auto: off)
        model_cfg = replace(config.model, dropout="keep" if config.model.dropout == "keep" else "off")
        resolve_split(config, info, max(map(len, self.source.prompt_ids), default=0)  # sequence_parallel=auto
                      + (rl.max_new_tokens or self.source.max_new_tokens))
        self.engine = Engine(config, build_model(model_cfg, deferred=True, **overrides), info,
                             total_steps=train.steps * updates_per_step + rl.warm_start_steps)
        self.engine.router_aux_coef = router_aux_coef(self.engine.features.hf_config, rl.loss.router_aux_loss_coef,
                                                      "rl.loss.router_aux_loss_coef")
        # The KL reference: a frozen copy of the initial model, or with LoRA the policy's own base model with
        # its adapters switched off (no second model in memory).
        self.reference = None
        if self.uses_reference and not self.engine.features.lora:
            self.reference = Engine(config, build_model(model_cfg, deferred=True, **overrides), info, trainable=False)
        # PPO: the value model, trained through its own engine over the same mini-batches
        self.critic = (Critic(config, info, train.steps * updates_per_step, **overrides)
                       if rl.algorithm == "ppo" else None)
        if roles:  # first: the weights group's set-up waits for every rollout rank, which waits for this
            share_network(roles, self.engine.features.plain_hf_config)
        self.channel = RolloutChannel(roles, info.device, config.dist.timeout_s) if roles else None
        self.rollout = None if roles else Rollout.beside(config, self.engine, self.tokenizer, self.source,
                                                         end_token_ids(config.model.path),
                                                         self._resident_beside(self.engine))
        self._hold_outside()
        keep_changed_bases(config, self.engine, self.critic.engine if self.critic else None, self.uses_reference)
        self.loss_fn = make_policy_loss(rl.loss, temperature=rl.temperature)
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints")
        self.resumed_from = self.checkpoints.resolve(train.resume)
        saved = self.checkpoints.load(self.resumed_from, self.engine, self._others) if self.resumed_from else {}
        self.start = int(saved.get("step", 0))
        drawer = BatchDrawer(config, (info.rank, info.world_size), self.rollout, self.source) if self.rollout else None
        self.batches = batch_producer(config, info, drawer, self.channel, self.engine.full_weights_by_unit)
        resumes = bool(self.resumed_from) and config.rollout_mode.off_policy
        rank_state = self.checkpoints.rank_state(self.resumed_from) if resumes else None
        self.queue_note = self.batches.start(rank_state, self.start)
        self.evaluation = Evaluation(config, info, self.rollout, self.tokenizer) if rl.eval_dataset else None
        self.logs = JobLogs()
        if info.is_main:
            self._open_logs(saved.get("loggers", {}))

    @property
    def uses_reference(self) -> bool:
        """A KL to the initial policy: in the loss (rl.loss.kl_coef) or in PPO's rewards (rl.kl_in_reward)."""
        return self.config.rl.loss.kl_coef > 0 or self.config.rl.kl_in_reward > 0

    @property
    def _others(self) -> dict[str, Engine]:
        """Engines checkpointed beside the actor's: PPO's critic, and a frozen reference the warm start set."""
        others = {"critic": self.critic.engine} if self.critic is not None else {}
        if self.reference is not None and self.config.rl.warm_start_steps:
            others["reference"] = self.reference
        return others

    def _hold_outside(self) -> None:
        """Tell each trained engine's auto what stays in memory outside it for the whole job: the rollout copy,
        the frozen reference, and the other model's parameters and optimizer state (PPO's actor and critic);
        every rank then budgets alike (auto agrees the budget over ranks)."""
        for engine in (e for e in (self.engine, self.critic.engine if self.critic else None) if e is not None):
            held = self.rollout.held_bytes if self.rollout is not None else 0
            engine.governor.hold_outside(held + self._resident_beside(engine))

    def _resident_beside(self, engine: Engine) -> int:
        """What the job's other models keep in memory beside ``engine`` the whole job: the frozen reference,
        and the other trained model's parameters and optimizer state (PPO's actor and critic)."""
        models = (self.reference, self.engine, self.critic.engine if self.critic else None)
        return sum(e.resident_bytes() for e in models if e is not None and e is not engine)

    def _open_logs(self, runs: dict[str, str]) -> None:
        """The job's logs opened (``runs``: the loggers' run ids a resumed checkpoint kept) and its first line."""
        train = self.config.train
        settings = LogSettings(train.logger, train.progress, train.log_every, train.steps, self.config.rl.algorithm)
        log_note = self.logs.open(config_to_dict(self.config), self.out_dir, settings,
                                  self.start if self.resumed_from else None, runs)
        rollout_words = self.rollout.describe() if self.rollout else rollout_ranks_line(self.config,
                                                                                         self.info.world_size)
        print(first_line(self.config, self.info.world_size, self.source, rollout_words,
                         self.critic.describe() if self.critic is not None else "", self.resumed_from, self.start)
              + self.queue_note + log_note, flush=True)

    def step(self, step: int) -> dict[str, Any]:
        """Rollouts; rewards and advantages on the whole rollout batch (PPO: the critic's values, token
        rewards, GAE); old (and reference) log-probs at the sampling temperature, before any update; then
        ``rl.epochs`` passes of ``rl.mini_batches`` optimizer steps each (PPO: the critic's first, over the
        same mini-batches; the actor's from step ``critic.warmup_steps`` on). Returns the step's metrics."""
        started = time.perf_counter()
        clock = PhaseClock()
        rl = self.config.rl
        scored = self.batches.take(step, clock)
        rewards = scored.rewards
        batch = dict(scored.batch)
        if self.critic is None:  # a group's samples (rl.agent: their segments carry the sample's advantage)
            batch["advantages"] = scored.per_row(advantages_for(scored.per_sample(rewards), self.config))
        else:
            batch["rewards"] = rewards.float()  # moves with its sample; GAE reads it after balancing
        rows = step_completions(scored, batch.get("advantages"), step + 1, self.config)
        if rows is not None:
            self.logs.log_completions(rows, step + 1)
        batch["rollout_log_probs"] = scored.log_probs  # moves with its sample; the loss reads it if asked
        with clock("balance"):
            batch, balance_metrics, counts = samples_that_train(batch, scored.per_sample(rewards), self.config.rl,
                                                                self.info, self.tokenizer.pad_token_id,
                                                                self.config.dist.timeout_s)
        sampler_log_probs = batch["rollout_log_probs"]
        if not (rl.loss.corrects_rollout or rl.loss.corrects_behavior):
            del batch["rollout_log_probs"]
        temperature = rl.temperature
        if self.uses_reference:
            with clock("ref_log_prob"):
                batch["ref_log_probs"] = self._reference_log_probs(batch)
        actor_trains = self.critic is None or step >= self.config.critic.warmup_steps
        # On-policy (one optimizer step per batch) the old log-probs are the update's own, detached: the loss
        # takes them from its forward (as TRL does), and no separate pass is needed -- unless the rewards need
        # them first (PPO's KL in the reward) or the actor does not train this step (the critic's warm-up).
        on_policy = (rl.mini_batches == 1 and rl.epochs == 1 and not rl.old_log_prob_pass and actor_trains
                     and not rl.kl_in_reward)
        if not on_policy:
            with clock("old_log_prob"):
                batch["old_log_probs"] = self.engine.forward_batch(batch, temperature=temperature).outputs["log_probs"]
        critic_metrics: dict[str, Any] = {}
        if self.critic is not None:
            with clock("values"):
                batch["values"] = self.critic.values(batch)
            kl = batch["old_log_probs"] - batch["ref_log_probs"] if rl.kl_in_reward else None  # verl's "kl" (k1)
            batch["advantages"], batch["returns"], critic_metrics = ppo_advantages(batch, self.config, self.info, kl)
        parts = list(mini_batches(batch, self.config.rl, self.config.train.seed, step, self.info.rank))
        if self.critic is not None:
            with clock("critic_update"):
                critic_metrics.update(self.critic.update(parts))
        updates = []
        if actor_trains:
            with clock("update"):
                updates = [self.engine.train_batch(part, self.loss_fn) for part in parts]
        before_update = batch["old_log_probs"] if not on_policy else self.engine.step_outputs.get("log_probs")
        if before_update is None:
            raise RuntimeError("the policy loss returned no per-sample 'log_probs' output; the on-policy GRPO step "
                               "takes the old log-probs from it (set rl.old_log_prob_pass=true otherwise)")
        # the critic's warm-up: no actor step (the row says so: 0 optimizer steps)
        metrics = combine_updates(updates) if updates else {"train/skipped": 0, "train/optimizer_steps": 0,
                                                            "stop/signal": 0.0}
        if critic_metrics:
            metrics.update(critic_metrics)
            metrics["stop/signal"] = max(metrics["stop/signal"], critic_metrics["critic/stop/signal"])
        metrics.update(balance_metrics)
        scoring = scoring_metrics(scored, self.source, self.info, self.config.dist.timeout_s)
        metrics.update({k: v for k, v in scoring.items() if k not in metrics})
        metrics.update(rollout_stats(scored, before_update, sampler_log_probs, batch["loss_mask"][:, 1:].double(),
                                     counts, self.info, self.config.dist.timeout_s,
                                     step if rl.is_off_policy else None))
        metrics["train/step"] = step + 1
        metrics.update(clock.metrics())
        remote_s = scored.rollout_rank_s if self.channel is not None else None  # not a resumed checkpoint's
        if remote_s is not None:
            metrics.update(rollout_rank_metrics(remote_s, self.channel.last))
        metrics.update(throughput(drawn_tokens(metrics), clock, updates, remote_s))
        metrics["time/step_s"] = time.perf_counter() - started
        if self.info.is_main:
            self.logs.log(metrics, progress_line(metrics))
        return metrics

    def warm_start(self) -> None:
        """``rl.warm_start_steps`` supervised steps on the task's correct responses through the same engine,
        then the reference (and a critic of the policy's weights) start from the warm-started policy
        (:mod:`syncwise.rl.warm_start`); a resumed run has had them already."""
        steps, rl = self.config.rl.warm_start_steps, self.config.rl
        if not steps or self.start > 0:
            return
        for step in range(steps):
            rows = self.source.batch(step, self.info.rank, self.info.world_size, rl.prompts_per_rank * 2)
            metrics = warm_start_step(self.engine, rows, self.source, self.tokenizer)
            if metrics["stop/signal"]:  # agreed by every rank; nothing to keep yet
                self.logs.close()
                raise stopped(metrics["stop/signal"], 0, self.config.train.steps,
                              f"during warm-start step {step + 1} of {steps}; nothing saved")
        notes = start_from_policy(self.config, self.engine, self.reference,
                                  self.critic.engine if self.critic else None, self.uses_reference)
        if self.info.is_main:
            print(f"syncwise train: warm start: {steps} supervised steps on the task's answers, "
                  f"loss {metrics['loss']:.3f}" + "".join(f"; {note}" for note in notes), flush=True)

    def _reference_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        temperature = self.config.rl.temperature
        if self.reference is not None:
            return self.reference.forward_batch(batch, temperature=temperature,
                                                token_cap=self.engine.token_cap).outputs["log_probs"]
        with adapters_disabled(self.engine.model):
            return self.engine.forward_batch(batch, temperature=temperature).outputs["log_probs"]

    def _evaluate(self, done: int) -> None:
        """Collective: ``rl.eval_dataset`` scored by the policy after ``done`` steps, where due (logged on rank 0)."""
        if self.evaluation is not None and self.evaluation.due(done):
            metrics = self.evaluation.run(done)
            if self.info.is_main:
                self.logs.log_eval(eval_row(done, metrics))

    def save(self, done: int) -> Path:
        """Collective: a checkpoint of the state after ``done`` steps (PPO: the critic's beside the actor's)."""
        return self.checkpoints.save(done, self.engine, {"step": done, "loggers": self.logs.run_ids()}, self._others,
                                     self.batches.state_dict())

    def finish(self) -> None:
        """Export, close the logs, plot and summarise."""
        if self.config.train.export:
            export_hf(self.engine, self.tokenizer, self.out_dir / "export", base_path=self.config.model.path)
            if self.critic is not None and self.config.critic.export:
                export_hf(self.critic.engine, self.tokenizer, self.out_dir / "export" / "critic",
                          base_path=self.critic.model_path)
        self.logs.close()
        if self.info.is_main and self.logs.history:  # the whole job's steps (a resumed run's memory has its own only)
            history = job_history(self.out_dir / "metrics.jsonl")
            plot_curves(history, self.out_dir / "curves.png", (("reward/mean", "eval/reward/mean"), "loss"))
            plot_phases(history, self.out_dir / "phases.png", [f"time/{phase}_s" for phase in PHASES])
            print_summary(history, self.out_dir)

    def run(self) -> list[dict[str, Any]]:
        """Train from the start (or the resumed) step to ``train.steps``; rank 0 returns every step's metrics.
        With rollout ranks, they end when this does (done, stopped or failed)."""
        try:
            return self._run()
        finally:
            self.batches.close()
            if self.rollout is not None:
                self.rollout.close()
            if self.channel is not None:
                self.channel.end()

    def _run(self) -> list[dict[str, Any]]:
        train = self.config.train
        consecutive_skips = 0
        self.warm_start()
        if self.start == 0:
            self._evaluate(0)
        for step in range(self.start, train.steps):
            metrics = self.step(step)
            done = step + 1
            # every optimizer step of the step skipped (the actor's, and PPO's critic's)
            steps = metrics["train/optimizer_steps"] + metrics.get("critic/train/optimizer_steps", 0)
            skipped = metrics["train/skipped"] + metrics.get("critic/train/skipped", 0)
            all_skipped = steps > 0 and skipped == steps
            consecutive_skips = consecutive_skips + 1 if all_skipped else 0
            if consecutive_skips >= train.max_consecutive_skips:
                path = self.save(done)
                raise TrainingStopped(
                    f"{consecutive_skips} consecutive steps had a non-finite gradient norm (last at step {done}); "
                    f"stopped, checkpoint at {path}"
                )
            stop = metrics["stop/signal"]  # agreed by every rank in the step's last all-reduce
            due = (train.checkpoint_every and done % train.checkpoint_every == 0) or done == train.steps
            if due or stop:
                path = self.save(done)
            if stop:
                self.logs.close()
                raise stopped(stop, done, train.steps, f"checkpoint {path}; rerun with train.resume=auto to go on")
            self._evaluate(done)
        self.finish()
        return self.logs.history


def run_rl(config: Config, info: DistInfo | None = None) -> list[dict[str, Any]]:
    """Train; rank 0 returns (and logs) every step's metrics."""
    return RLTrainer(config, info or init_distributed(config.dist.backend, config.dist.timeout_s)).run()
