"""`syncwise dpo`: preference optimisation through the engine -- TRL's preference data and losses, a frozen
reference (the initial policy, ``dpo.ref_model.path``, the base with LoRA's adapters off, or scored once before
training), checkpoints that resume at the exact next pair, evaluation, and a Hugging Face export.

One step: the next ``dpo.batch_size`` pairs of the order, split over the ranks by length (a pair whole on one rank),
each pair's chosen and rejected rows side by side in one micro-batch (packed together; their common prompt computed
once where the model allows, ``engine.share_prefixes``). The reference scores them (forward-only), and the update's
own forward computes the pairs' loss (:func:`~syncwise.losses.preference.pair_loss`), as TRL does. Where a fixed
``engine.max_tokens_per_micro_batch`` is below a pair, the pairs are scored first by a forward-only pass of the
policy and each sequence's gradient coefficient trains through
:data:`~syncwise.losses.preference.coefficient_loss` -- the loss's own gradient, however the micro-batches split the
pairs. Logged as TRL names them: ``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``; ``dpo/one_pass`` says which way the step trained."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointManager
from ..config import Config, config_to_dict
from ..data.batching import ROW_GROUP, split_lengths
from ..data.preference import PreferenceData, preference_batch
from ..data.sft_dataset import SampleOrder, rank_share
from ..engine import Engine
from ..engine.sequence_parallel import resolve_split
from ..export import export_hf
from ..logs import JobLogs, LogSettings
from ..losses.preference import (
    PAIR_SIDE,
    REF_LOG_PROB,
    PairScores,
    PreferenceSettings,
    coefficient_loss,
    pair_loss,
    pair_losses,
    sequence_coefficients,
    sequence_log_probs,
)
from ..metrics import format_step, job_history, plot_curves
from ..models import build_model
from ..models.lora import adapters_disabled
from ..runtime.distributed import DistInfo
from ..runtime.signals import stopped
from ..sft.data import load_sft_tokenizer
from .data import preference_inputs

EVAL_CHUNK = 128  # held-out pairs per forward-only pass (over all ranks)
CURVES = (("loss", "eval/loss"), ("rewards/accuracies", "eval/rewards/accuracies"),
          ("rewards/margins", "eval/rewards/margins"))
SCORES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
          "logps/rejected")


@dataclass
class PreparedStep:
    """A step's pairs (all ranks'), this rank's batch and the loss that trains it, and the pairs' scores: already
    ``scored`` (the coefficient path), else from the update's outputs (:meth:`scores`)."""

    pairs: list[int]
    batch: dict[str, torch.Tensor]
    loss_fn: Callable[..., Any]
    scored: PairScores | None
    data_s: float
    score_s: float  # the reference's pass, and the policy's scoring pass where the pairs may be split
    trainer: DPOTrainer

    def scores(self, outputs: dict[str, torch.Tensor]) -> PairScores:
        """This rank's pairs' scores; ``outputs``: the update's (its per-target ``log_probs``)."""
        if self.scored is not None:
            return self.scored
        policy, tokens = sequence_log_probs(outputs["log_probs"].cpu(), self.batch)
        score, chosen, rejected = self.trainer._pair_scores(policy, tokens, self.batch.get(REF_LOG_PROB))
        with torch.no_grad():
            return score(chosen, rejected)


class DPOTrainer:
    """One rank's DPO job."""

    def __init__(self, config: Config, info: DistInfo):
        """Set-up: pairs and tokenizer, the policy's engine and the reference, checkpoints (resuming if asked)
        and, on rank 0, the logs."""
        self.config, self.info = config, info
        dpo = config.dpo
        self.out_dir = Path(dpo.out_dir)
        torch.manual_seed(dpo.seed * 1000 + info.rank)
        random.seed(dpo.seed * 1000 + info.rank)
        self.tokenizer = load_sft_tokenizer(dpo.tokenizer or config.model.path)
        self.data, self.eval_data, self.length_note = preference_inputs(config, self.tokenizer, info.world_size)
        self.pad_id = self.tokenizer.pad_token_id
        self.settings = PreferenceSettings(tuple(dpo.losses), tuple(dpo.weights), dpo.beta, dpo.label_smoothing,
                                           dpo.simpo_gamma)
        self.order = SampleOrder(self.data.lengths, dpo.seed)
        self.total_steps = dpo.steps or self.order.steps_for(dpo.epochs, dpo.batch_size, 0, info.world_size)
        # Dropout off unless kept on purpose (TRL's disable_dropout): the scoring pass and the training pass must
        # see one network, or the coefficients would be another pass's
        model_cfg = replace(config.model, dropout="keep" if config.model.dropout == "keep" else "off")
        resolve_split(config, info, int(max(self.data.lengths)))  # dist.sequence_parallel=auto: for the longest
        self.engine = Engine(config, build_model(model_cfg, deferred=True), info, total_steps=self.total_steps)
        self.reference = self._reference(model_cfg)
        self.precomputed: dict[str, torch.Tensor] = {}
        if dpo.precompute_ref_log_probs:
            self.precomputed = {"train": self._score_reference(self.data)}
            if self.eval_data is not None:
                self.precomputed["eval"] = self._score_reference(self.eval_data)
            self.reference = None  # held no longer: training needs the policy alone
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints")
        self.resumed_from = self.checkpoints.resolve(dpo.resume)
        state = self.checkpoints.load(self.resumed_from, self.engine) if self.resumed_from else {}
        self.start, self.position = int(state.get("step", 0)), int(state.get("position", 0))
        self._next_position = self.position  # where the prepared step's pairs end
        self.logs = JobLogs()
        if info.is_main:
            self._open_logs(state.get("loggers", {}))

    def _reference(self, model_cfg) -> Engine | None:
        """The frozen reference: ``dpo.ref_model.path``'s model, else a copy of the initial policy; None where the
        policy's own base serves (LoRA: its adapters switched off) or none is needed (SimPO)."""
        dpo = self.config.dpo
        if dpo.reference_free:
            return None
        if dpo.ref_model.path:
            ref_cfg = replace(model_cfg, path=dpo.ref_model.path, lora=replace(model_cfg.lora, rank=0))
            return Engine(self.config, build_model(ref_cfg, deferred=True), self.info, trainable=False)
        if self.engine.features.lora:
            return None
        return Engine(self.config, build_model(model_cfg, deferred=True), self.info, trainable=False)

    def _open_logs(self, runs: dict[str, str]) -> None:
        dpo = self.config.dpo
        settings = LogSettings(dpo.logger, dpo.progress, dpo.log_every, self.total_steps, "dpo")
        log_note = self.logs.open(config_to_dict(self.config), self.out_dir, settings,
                                  self.start if self.resumed_from else None, runs)
        held = f"; eval {self.eval_data.describe()}" if self.eval_data is not None else ""
        if self.length_note:
            print(f"syncwise dpo: {self.length_note}", flush=True)
        print(f"syncwise dpo: {self.data.describe()}{held}", flush=True)
        losses = " + ".join(f"{w:g} x {name}" if len(dpo.losses) > 1 else name
                            for name, w in zip(dpo.losses, dpo.weights, strict=True))
        print(f"syncwise dpo: loss {losses}, beta {dpo.beta:g}; reference: {self._describe_reference()}", flush=True)
        print(
            f"syncwise dpo: {self.config.engine.strategy} on {self.info.world_size} rank(s), sync.mode="
            f"{self.config.sync.mode}, {self.config.engine.split_label}, "
            f"{self.engine.wrapped.num_units} FSDP units; {self.total_steps} steps of {dpo.batch_size} pairs "
            f"({self.total_steps * dpo.batch_size / len(self.data):.3g} epochs)"
            + (f", resumed from {self.resumed_from} at step {self.start}" if self.resumed_from else "") + log_note,
            flush=True,
        )

    def _describe_reference(self) -> str:
        dpo = self.config.dpo
        if dpo.reference_free:
            return "none (simpo)"
        where = dpo.ref_model.path or ("the base model, LoRA's adapters off" if self.engine.features.lora
                                       else "the initial policy, frozen")
        return where + (", scored once before training (dpo.precompute_ref_log_probs)" if self.precomputed else "")

    def _reference_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Collective: the reference's summed completion log-probs of each row of ``batch``."""
        if self.reference is not None:
            log_probs = self.reference.forward_batch(batch, token_cap=self.engine.token_cap).outputs["log_probs"]
        else:
            with adapters_disabled(self.engine.model):
                log_probs = self.engine.forward_batch(batch).outputs["log_probs"]
        return sequence_log_probs(log_probs, batch)[0]

    def _score_reference(self, data: PreferenceData) -> torch.Tensor:
        """Collective: every pair's reference log-probs [P, 2] (chosen, rejected), each rank scoring its share."""
        scored = torch.zeros(len(data), 2, dtype=torch.float64)
        for chunk in torch.arange(len(data)).tensor_split(max(1, -(-len(data) // EVAL_CHUNK))):
            mine = rank_share(chunk.tolist(), data.lengths, self.info.rank, self.info.world_size)
            sums = self._reference_log_probs(preference_batch(data, mine, self.pad_id))
            scored[mine] = sums.view(-1, 2).cpu()
        if self.info.world_size > 1:
            dist.all_reduce(scored)  # each pair scored on one rank, zeros elsewhere
        return scored

    def _reference_sums(self, pairs: list[int], batch: dict[str, torch.Tensor], which: str) -> torch.Tensor | None:
        """Collective (unless precomputed): the reference's summed log-probs of ``batch``'s rows; None for SimPO."""
        if self.config.dpo.reference_free:
            return None
        if self.precomputed:
            return self.precomputed[which][pairs].reshape(-1)
        return self._reference_log_probs(batch).cpu()

    def _pair_scores(self, policy: torch.Tensor, tokens: torch.Tensor, ref: torch.Tensor | None
                     ) -> tuple[Callable[..., PairScores], torch.Tensor, torch.Tensor]:
        """The policy's summed log-probs of the chosen [P] and rejected [P] rows, and the pairs' score as a function
        of them (the reference's and the token counts fixed)."""
        chosen, rejected = policy[0::2].cpu(), policy[1::2].cpu()
        ref_chosen, ref_rejected = (ref[0::2], ref[1::2]) if ref is not None else (None, None)
        tokens = tokens.cpu()
        score = partial(_score, ref_chosen=ref_chosen, ref_rejected=ref_rejected, chosen_tokens=tokens[0::2],
                        rejected_tokens=tokens[1::2], settings=self.settings)
        return score, chosen, rejected

    def _scores(self, pairs: list[int], batch: dict[str, torch.Tensor],
                which: str) -> tuple[Callable[..., PairScores], torch.Tensor, torch.Tensor]:
        """Collective: :meth:`_pair_scores` of the policy's forward-only pass over ``batch``."""
        policy, tokens = sequence_log_probs(self.engine.forward_batch(batch).outputs["log_probs"], batch)
        return self._pair_scores(policy, tokens, self._reference_sums(pairs, batch, which))

    def _fits_one_pass(self, batch: dict[str, torch.Tensor]) -> bool:
        """Collective where a fixed token cap is set: whether every rank's pairs fit a micro-batch each (auto's cap
        grows to the longest pair; without a cap, a micro-batch holds at least one pair)."""
        cap = self.config.engine.fixed_split[1]
        if self.engine.token_cap or cap <= 0:
            return True
        fits = torch.tensor([float(int(split_lengths(batch, self.engine.features.packing).max()) <= cap)])
        if self.info.world_size > 1:
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        return bool(fits.item())

    def prepare(self) -> PreparedStep:
        """Collective: the next step's pairs (all ranks'), this rank's batch of them and the loss that trains it --
        in the update's own forward where each pair fits one micro-batch, else with each sequence's coefficient from
        a scoring pass (see :mod:`syncwise.losses.preference`)."""
        dpo = self.config.dpo
        started = time.perf_counter()
        pairs, self._next_position = self.order.step(self.position, dpo.batch_size, 0, self.info.world_size)
        mine = rank_share(pairs, self.data.lengths, self.info.rank, self.info.world_size)
        batch = preference_batch(self.data, mine, self.pad_id)
        batch[ROW_GROUP] = torch.arange(len(mine)).repeat_interleave(2)  # a pair's rows in one micro-batch
        batch[PAIR_SIDE] = torch.tensor([0, 1]).repeat(len(mine))
        data_s = time.perf_counter() - started
        if self._fits_one_pass(batch):
            ref = self._reference_sums(mine, batch, "train")
            if ref is not None:
                batch[REF_LOG_PROB] = ref
            return PreparedStep(pairs, batch, pair_loss(self.settings), None, data_s,
                                time.perf_counter() - started - data_s, self)
        del batch[ROW_GROUP]  # the pairs may be split: each sequence's coefficient makes that exact
        score, chosen, rejected = self._scores(mine, batch, "train")
        batch["sequence_coefficient"] = sequence_coefficients(chosen, rejected, score, len(pairs))
        with torch.no_grad():
            scores = score(chosen, rejected)
        return PreparedStep(pairs, batch, coefficient_loss, scores, data_s, time.perf_counter() - started - data_s,
                            self)

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step on the next pairs of the order; returns its metrics (same on every rank)."""
        started = time.perf_counter()
        prepared = self.prepare()
        metrics = self.engine.train_batch(prepared.batch, prepared.loss_fn)
        scores = prepared.scores(self.engine.step_outputs)
        pairs = prepared.pairs
        self.position = self._next_position
        metrics.update(self.reduce(scores, len(pairs)))
        metrics.update({
            "train/step": step + 1,
            "data/epoch": self.position / len(self.data),
            "data/pairs": len(pairs),
            "data/truncated_fraction": sum(self.data.truncated[i] for i in pairs) / len(pairs),
            "data/dropped": self.data.dropped,
            "data/skipped": self.data.skipped,
            "dpo/one_pass": float(prepared.scored is None),
            "time/data_s": prepared.data_s,
            "time/score_s": prepared.score_s,
            "time/step_s": time.perf_counter() - started,
        })
        return metrics

    def reduce(self, scores: PairScores, pairs: int, prefix: str = "") -> dict[str, float]:
        """Collective: the step's pairs' means over every rank, as TRL logs them."""
        sums = torch.stack([scores.loss.sum(), scores.chosen_rewards.sum(), scores.rejected_rewards.sum(),
                            (scores.chosen_rewards > scores.rejected_rewards).double().sum(),
                            (scores.chosen_rewards - scores.rejected_rewards).sum(), scores.chosen_logps.sum(),
                            scores.rejected_logps.sum()]).double()
        if self.info.world_size > 1:
            dist.all_reduce(sums)
        return {f"{prefix}{name}": float(value) / pairs for name, value in zip(SCORES, sums.tolist(), strict=True)}

    def evaluate(self) -> dict[str, float]:
        """Collective: the held-out pairs' loss and rewards, forward-only, every rank its share of each chunk."""
        data = self.eval_data
        totals: dict[str, float] = dict.fromkeys(SCORES, 0.0)
        for chunk in torch.arange(len(data)).tensor_split(max(1, -(-len(data) // EVAL_CHUNK))):
            pairs = chunk.tolist()
            mine = rank_share(pairs, data.lengths, self.info.rank, self.info.world_size)
            score, chosen, rejected = self._scores(mine, preference_batch(data, mine, self.pad_id), "eval")
            with torch.no_grad():
                for name, value in self.reduce(score(chosen, rejected), len(data)).items():
                    totals[name] += value
        return {f"eval/{name}": value for name, value in totals.items()}

    def save(self, done: int) -> Path:
        """Collective: a checkpoint after ``done`` steps, with the position in the pair order."""
        return self.checkpoints.save(done, self.engine, {"step": done, "position": self.position,
                                                         "loggers": self.logs.run_ids()})

    def run(self) -> list[dict[str, Any]]:
        """Train from the start (or the resumed) step; rank 0 returns every step's metrics of this run."""
        dpo = self.config.dpo
        history = []
        for step in range(self.start, self.total_steps):
            metrics = self.step(step)
            done = step + 1
            if self.eval_data is not None and ((dpo.eval_every and done % dpo.eval_every == 0)
                                               or done == self.total_steps):
                metrics.update(self.evaluate())
            history.append(metrics)
            self._log(metrics)
            stop = metrics["stop/signal"]  # agreed by every rank in the step's last all-reduce
            due = (dpo.checkpoint_every and done % dpo.checkpoint_every == 0) or done == self.total_steps
            if due or stop:
                path = self.save(done)
            if stop:
                self.logs.close()
                raise stopped(stop, done, self.total_steps, f"checkpoint {path}; rerun with dpo.resume=auto to go on")
        self.finish()
        return history

    def _log(self, metrics: dict[str, Any]) -> None:
        if not self.info.is_main:
            return
        words = (f"loss {metrics['loss']:.4f} accuracy {metrics['rewards/accuracies']:.3f} "
                 f"margin {metrics['rewards/margins']:.4f}")
        if self.logs.bar is not None:
            self.logs.log(metrics, words)
            return
        line = format_step(metrics) + f" | accuracy {metrics['rewards/accuracies']:.3f} margin " \
            f"{metrics['rewards/margins']:.4f}"
        if "eval/loss" in metrics:
            line += (f" | eval loss {metrics['eval/loss']:.4f} accuracy {metrics['eval/rewards/accuracies']:.3f} "
                     f"margin {metrics['eval/rewards/margins']:.4f}")
        self.logs.log(metrics, line, always="eval/loss" in metrics)

    def finish(self) -> None:
        """Export (model and tokenizer), close the logs, plot and summarise the whole job."""
        if self.config.dpo.export:
            export_hf(self.engine, self.tokenizer, self.out_dir / "export", base_path=self.config.model.path)
        self.logs.close()
        if self.info.is_main:
            history = job_history(self.out_dir / "metrics.jsonl")
            plot_curves(history, self.out_dir / "curves.png", CURVES)
            first, last = history[0], history[-1]
            summary = (f"loss {first['loss']:.4f} -> {last['loss']:.4f}; rewards/accuracies "
                       f"{first['rewards/accuracies']:.3f} -> {last['rewards/accuracies']:.3f}, rewards/margins "
                       f"{first['rewards/margins']:.4f} -> {last['rewards/margins']:.4f}")
            export = f", export {self.out_dir / 'export'}" if self.config.dpo.export else ""
            print(f"{summary}; metrics {self.out_dir / 'metrics.jsonl'}, plot {self.out_dir / 'curves.png'}{export}",
                  flush=True)


def _score(chosen: torch.Tensor, rejected: torch.Tensor, *, ref_chosen, ref_rejected, chosen_tokens,
           rejected_tokens, settings: PreferenceSettings) -> PairScores:
    as_policy = {"dtype": chosen.dtype}
    ref_c = ref_chosen.to(**as_policy) if ref_chosen is not None else None
    ref_r = ref_rejected.to(**as_policy) if ref_rejected is not None else None
    return pair_losses(chosen, rejected, ref_c, ref_r, chosen_tokens.to(**as_policy),
                       rejected_tokens.to(**as_policy), settings)


def run_dpo(config: Config, info: DistInfo) -> list[dict[str, Any]]:
    """Train; rank 0 returns this run's steps' metrics."""
    return DPOTrainer(config, info).run()
