"""TRL's DPOTrainer on `syncwise bench --workload dpo`'s job, as TRL users run it on CPU: ``torchrun
--nproc-per-node 2`` with ``use_cpu=True`` -- the same model, pairs (a preference JSONL in TRL's format), loss
(``sigmoid``, beta 0.1) and shape (PAIRS pairs a step over all processes, one optimizer step a batch, lr 1e-5
constant, grad clip 1, fp32, dropout off). Writes each step's wall time and each process's peak resident memory to
OUT (JSON lines from rank 0), for the side by side the bench prints:

    torchrun --nproc-per-node 2 docs/bench/trl_dpo.py MODEL PAIRS_JSONL OUT STEPS PAIRS_PER_STEP
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch.distributed as dist
from datasets import load_dataset
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer


class StepLog(TrainerCallback):
    """Each optimizer step's wall time (rank 0), and at the end every process's peak RSS."""

    def __init__(self, out: str):
        self.out, self.started = out, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self.started
        if state.is_world_process_zero:
            with open(self.out, "a") as f:
                f.write(json.dumps({"step": state.global_step, "step_s": seconds}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        peak = [None] * dist.get_world_size()
        dist.all_gather_object(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if state.is_world_process_zero:
            with open(self.out, "a") as f:
                f.write(json.dumps({"peak_rss_bytes": peak}) + "\n")


def main() -> None:
    model, pairs, out, steps, per_step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    dataset = load_dataset("json", data_files=pairs, split="train")
    config = DPOConfig(
        output_dir=f"{out}.trl", use_cpu=True, per_device_train_batch_size=per_step // world,
        gradient_accumulation_steps=1, loss_type=["sigmoid"], beta=0.1, learning_rate=1e-5,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, max_steps=steps, max_length=1024,
        logging_steps=1, report_to="none", save_strategy="no", bf16=False, seed=0, ddp_backend="gloo",
        model_init_kwargs={"dtype": "float32"}, dataloader_drop_last=True,
    )
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, callbacks=[StepLog(out)])
    trainer.train()


if __name__ == "__main__":
    main()
