"""TRL's GRPOTrainer on issue 71's job, as TRL users run it on CPU: ``torchrun --nproc-per-node 2`` with
``use_cpu=True`` -- the same model (the SFT example's export), prompts (its prompts.jsonl), reward (syncwise's
``final_number`` in TRL's signature) and shape (4 prompts x 8 completions a process, 64 new tokens, temperature 1,
no KL, lr 1e-4 constant, grad clip 1, one optimizer step per generation). Writes each step's wall time and its
completion tokens to OUT (one JSON line a step, rank 0), for the side by side in docs/benchmarks.md:

    torchrun --nproc-per-node 2 docs/bench/trl_grpo.py MODEL PROMPTS OUT [STEPS]
"""

from __future__ import annotations

import json
import sys
import time

from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from syncwise.rewards import final_number


def correct(completions, answer, **kwargs):
    """syncwise's final_number as a TRL reward function."""
    return [final_number(None, c, {"answer": a}) for c, a in zip(completions, answer, strict=True)]


class StepLog(TrainerCallback):
    """Each optimizer step's wall time (rank 0) and its completions' mean length, from TRL's own logs."""

    def __init__(self, out: str):
        self.out, self.started, self.seconds = out, 0.0, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "completions/mean_length" in logs:
            with open(self.out, "a") as f:
                f.write(json.dumps({"step": state.global_step, "step_s": self.seconds,
                                    "mean_length": logs["completions/mean_length"], "reward": logs.get("reward")})
                        + "\n")


def main() -> None:
    model, prompts, out = sys.argv[1:4]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    dataset = load_dataset("json", data_files=prompts, split="train")
    config = GRPOConfig(
        output_dir=f"{out}.trl", use_cpu=True, per_device_train_batch_size=32, num_generations=8,
        max_completion_length=64, temperature=1.0, beta=0.0, learning_rate=1e-4, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, gradient_accumulation_steps=1, num_iterations=1, max_steps=steps,
        logging_steps=1, report_to="none", save_strategy="no", bf16=False, seed=0, ddp_backend="gloo",
        model_init_kwargs={"dtype": "float32"},
    )
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset,
                          callbacks=[StepLog(out)])
    trainer.train()


if __name__ == "__main__":
    main()
