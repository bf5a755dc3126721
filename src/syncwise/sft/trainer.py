"""`syncwise sft`: supervised fine-tuning through the engine -- a dataset or a built-in task, epochs in a
deterministic order, evaluation, checkpoints that resume at the exact next sample, and a Hugging Face export
with the tokenizer (and its chat template).

One step: the next ``sft.batch_size`` samples of the order (or ``sft.batch_tokens`` real tokens), split over
the ranks by length, one ``Engine.train_batch`` with the token-mean cross-entropy over the step's loss
tokens on every rank. Evaluation is a forward-only pass of every rank's share of the held-out rows.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointManager
from ..config import Config, config_to_dict
from ..data.sft_dataset import SampleOrder, padded_batch, rank_share
from ..engine import Engine
from ..engine.sequence_parallel import resolve_split
from ..export import export_hf
from ..logs import JobLogs, LogSettings
from ..losses import sft_loss
from ..metrics import format_step, job_history, plot_curves
from ..models import build_model
from ..models.moe import router_aux_coef
from ..runtime.distributed import DistInfo
from ..runtime.signals import stopped
from .data import sft_inputs, write_task_data

EVAL_CHUNK = 256  # held-out rows per forward-only pass (over all ranks)
CURVES = (("loss", "eval/loss"), ("token_accuracy", "eval/token_accuracy"))


class SFTTrainer:
    """One rank's SFT job."""

    def __init__(self, config: Config, info: DistInfo):
        """Set-up: data and tokenizer, the engine, checkpoints (resuming if asked) and, on rank 0, the logs."""
        self.config, self.info = config, info
        sft = config.sft
        self.out_dir = Path(sft.out_dir)
        torch.manual_seed(sft.seed * 1000 + info.rank)
        random.seed(sft.seed * 1000 + info.rank)
        if info.is_main:
            write_task_data(config)
        if info.world_size > 1:
            dist.barrier()
        inputs = sft_inputs(config)
        self.length_note = inputs.note
        self.tokenizer, self.data, self.eval_data, self.model_path = (inputs.tokenizer, inputs.train, inputs.eval,
                                                                      inputs.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        inputs.check_world(info.world_size, sft)
        self.order = SampleOrder(self.data.lengths, sft.seed)
        self.total_steps = sft.steps or self.order.steps_for(sft.epochs, sft.batch_size, sft.batch_tokens,
                                                             info.world_size)
        model_config = replace(config.model, path=self.model_path)  # the arith_chat task brings its own model
        resolve_split(config, info, int(max(self.data.lengths)), model_config)  # sequence_parallel=auto
        self.engine = Engine(config, build_model(model_config, deferred=True), info, total_steps=self.total_steps)
        self.engine.router_aux_coef = router_aux_coef(self.engine.features.hf_config, sft.router_aux_loss_coef,
                                                      "sft.router_aux_loss_coef")
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints")
        self.resumed_from = self.checkpoints.resolve(sft.resume)
        state = self.checkpoints.load(self.resumed_from, self.engine) if self.resumed_from else {}
        self.start, self.position = int(state.get("step", 0)), int(state.get("position", 0))
        self.logs = JobLogs()
        if info.is_main:
            self._open_logs(state.get("loggers", {}))

    def _open_logs(self, runs: dict[str, str]) -> None:
        """The logs opened (``runs``: the loggers' run ids a resumed checkpoint kept) and the job's first lines."""
        sft = self.config.sft
        settings = LogSettings(sft.logger, sft.progress, sft.log_every, self.total_steps, "sft")
        log_note = self.logs.open(config_to_dict(self.config), self.out_dir, settings,
                                  self.start if self.resumed_from else None, runs)
        size = (f"{sft.batch_tokens} tokens" if sft.batch_tokens else
                f"{sft.batch_size} sequences ({self.total_steps * sft.batch_size / len(self.data):.3g} epochs)")
        held = f"; eval {self.eval_data.describe()}" if self.eval_data is not None else ""
        if self.length_note:
            print(f"syncwise sft: {self.length_note}", flush=True)
        print(f"syncwise sft: {self.data.describe()}{held}", flush=True)
        print(
            f"syncwise sft: {self.config.engine.strategy} on {self.info.world_size} rank(s), sync.mode="
            f"{self.config.sync.mode}, {self.config.engine.split_label}, "
            f"{self.engine.wrapped.num_units} FSDP units; {self.total_steps} steps of {size}"
            + (f", resumed from {self.resumed_from} at step {self.start}" if self.resumed_from else "") + log_note,
            flush=True,
        )

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step on the next samples of the order; returns its metrics (same on every rank)."""
        sft = self.config.sft
        started = time.perf_counter()
        samples, next_position = self.order.step(self.position, sft.batch_size, sft.batch_tokens,
                                                 self.info.world_size)
        mine = rank_share(samples, self.data.lengths, self.info.rank, self.info.world_size)
        batch = padded_batch(self.data, mine, self.pad_id)
        data_s = time.perf_counter() - started
        metrics = self.engine.train_batch(batch, sft_loss)
        self.position = next_position
        metrics.update({
            "train/step": step + 1,
            "data/epoch": self.position / len(self.data),
            "data/samples": len(samples),
            "data/truncated_fraction": sum(self.data.truncated[i] for i in samples) / len(samples),
            "data/dropped": self.data.dropped,
            "data/skipped": self.data.skipped,
            "time/data_s": data_s,
            "time/step_s": time.perf_counter() - started,
        })
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Collective: the held-out rows' token-mean loss and token accuracy, forward-only, every rank its share
        of each chunk; chunks weighted by their loss tokens (known alike on every rank)."""
        data = self.eval_data
        chunks = torch.arange(len(data)).tensor_split(max(1, -(-len(data) // EVAL_CHUNK)))
        total = {"loss": 0.0, "token_accuracy": 0.0}
        weight = 0.0
        for chunk in chunks:
            rows = chunk.tolist()
            mine = rank_share(rows, data.lengths, self.info.rank, self.info.world_size)
            result = self.engine.eval_batch(padded_batch(data, mine, self.pad_id), sft_loss)
            tokens = float(sum(sum(data.loss_masks[i][1:]) for i in rows))
            for key in total:
                total[key] += result.metrics[key] * tokens
            weight += tokens
        return {f"eval/{key}": value / weight for key, value in total.items()}

    def save(self, done: int) -> Path:
        """Collective: a checkpoint after ``done`` steps, with the position in the sample order."""
        return self.checkpoints.save(done, self.engine, {"step": done, "position": self.position,
                                                         "loggers": self.logs.run_ids()})

    def run(self) -> list[dict[str, Any]]:
        """Train from the start (or the resumed) step; rank 0 returns every step's metrics of this run."""
        sft = self.config.sft
        history = []
        for step in range(self.start, self.total_steps):
            metrics = self.step(step)
            done = step + 1
            if self.eval_data is not None and ((sft.eval_every and done % sft.eval_every == 0)
                                               or done == self.total_steps):
                metrics.update(self.evaluate())
            history.append(metrics)
            self._log(metrics, done)
            stop = metrics["stop/signal"]  # agreed by every rank in the step's last all-reduce
            due = (sft.checkpoint_every and done % sft.checkpoint_every == 0) or done == self.total_steps
            if due or stop:
                path = self.save(done)
            if stop:
                self._close()
                raise stopped(stop, done, self.total_steps, f"checkpoint {path}; rerun with sft.resume=auto to go on")
        self.finish()
        return history

    def _log(self, metrics: dict[str, Any], done: int) -> None:
        if not self.info.is_main:
            return
        if self.logs.bar is not None:
            self.logs.log(metrics, f"loss {metrics['loss']:.4f} {metrics['sync/mode']}")
            return
        line = format_step(metrics)
        if "eval/loss" in metrics:
            line += f" | eval loss {metrics['eval/loss']:.4f} acc {metrics['eval/token_accuracy']:.3f}"
        self.logs.log(metrics, line, always="eval/loss" in metrics)

    def _close(self) -> None:
        self.logs.close()

    def finish(self) -> None:
        """Export (model and tokenizer), close the logs, plot and summarise the whole job."""
        if self.config.sft.export:
            export_hf(self.engine, self.tokenizer, self.out_dir / "export", base_path=self.model_path)
        self._close()
        if self.info.is_main:
            history = job_history(self.out_dir / "metrics.jsonl")
            plot_curves(history, self.out_dir / "curves.png", CURVES)
            evals = [r for r in history if "eval/loss" in r]
            summary = f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}"
            if evals:
                summary += f"; eval loss {evals[0]['eval/loss']:.4f} -> {evals[-1]['eval/loss']:.4f}"
            export = f", export {self.out_dir / 'export'}" if self.config.sft.export else ""
            print(f"{summary}; metrics {self.out_dir / 'metrics.jsonl'}, plot {self.out_dir / 'curves.png'}"
                  f"{export}", flush=True)


def run_sft(config: Config, info: DistInfo) -> list[dict[str, Any]]:
    """Train; rank 0 returns this run's steps' metrics."""
    return SFTTrainer(config, info).run()
