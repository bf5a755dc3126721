"""Run on 1 and 2 gloo ranks by test_dpo.py: the first step of `syncwise dpo` for every loss type and layout
(packed with the shared prompt, packed without it, padded -- each in another sync mode), its scores and gradient,
against an independent computation in the test process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from scenarios import full_grads
from syncwise.config import load_config
from syncwise.dpo.trainer import DPOTrainer

LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
# each layout in another sync mode; at most 3 rows a micro-batch: one pair in each, its loss in the update's forward;
# "split": a fixed token cap that holds the longest row but no pair, so pairs are split across micro-batches and
# trained through their coefficients from a scoring pass
FIXED_ROWS = ["engine.micro_batch_size=3", "engine.max_tokens_per_micro_batch=0"]
LAYOUTS = {"shared": ["engine.packing=true", "engine.share_prefixes=true", "sync.mode=deferred", *FIXED_ROWS],
           "packed": ["engine.packing=true", "engine.share_prefixes=false", "sync.mode=per_microbatch", *FIXED_ROWS],
           "padded": ["engine.packing=false", "sync.mode=deferred_unsharded", *FIXED_ROWS],
           "split": ["engine.packing=true", "engine.share_prefixes=true", "sync.mode=deferred",
                     "engine.micro_batch_size=0", "engine.max_tokens_per_micro_batch={longest_row}"]}


def longest_row(folder: Path) -> int:
    """The longest chosen or rejected sequence of the pairs, as TRL tokenises them (prompt + completion whole)."""
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "llama")
    rows = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    return max(len(tokenizer.apply_chat_template(row["prompt"] + row[side], return_dict=True)["input_ids"])
               for row in rows for side in ("chosen", "rejected"))


def dpo_config(folder: Path, loss: str, layout: str, *extra: str):
    reference = [] if loss == "simpo" else [f"dpo.ref_model.path={folder / 'reference'}"]
    smoothing = ["dpo.label_smoothing=0.2"] if loss in ("robust", "simpo") else []
    return load_config(None, [
        f"model.path={folder / 'llama'}", f"dpo.dataset={folder / 'pairs.jsonl'}", f"dpo.loss_type={loss}",
        "dpo.batch_size=6", "dpo.beta=0.5", f"dpo.out_dir={folder / 'runs' / loss / layout}", "dpo.progress=false",
        "dpo.export=false", "engine.fused_lm_head=false", "optim.name=sgd", "optim.lr=0", "optim.grad_clip=0",
        *reference, *smoothing, *(key.format(longest_row=longest_row(folder)) for key in LAYOUTS[layout]), *extra])


def _first_step(trainer: DPOTrainer) -> dict:
    """The step's pairs, the reduced scores, the full gradient of its loss and whether it trained in one pass (the
    gradient zeroed after: the trainer serves the next loss)."""
    prepared = trainer.prepare()
    result = trainer.engine.forward_backward_batch(prepared.batch, prepared.loss_fn)
    scores = prepared.scores(result.outputs)
    out = {"pairs": prepared.pairs, "scores": trainer.reduce(scores, len(prepared.pairs)),
           "grads": full_grads(trainer.engine), "one_pass": prepared.scored is None}
    trainer.engine.optimizer.zero_grad(set_to_none=True)
    return out


def dpo_suite(info, folder: str) -> dict:
    """Per (loss, layout): the step's pairs, scores and gradient. One trainer a layout serves the reference-based
    losses in turn (the loss is the trainer's settings; its engines do not depend on it), another simpo."""
    folder = Path(folder)
    out: dict = {}
    for layout in LAYOUTS:
        trainer = DPOTrainer(dpo_config(folder, "sigmoid", layout), info)
        for loss in LOSSES[:-1]:
            smoothing = 0.2 if loss == "robust" else 0.0
            trainer.settings = replace(trainer.settings, losses=(loss,), label_smoothing=smoothing)
            out[loss, layout] = _first_step(trainer)
        trainer.logs.close()
        simpo = DPOTrainer(dpo_config(folder, "simpo", layout), info)
        out["simpo", layout] = _first_step(simpo)
        simpo.logs.close()
    # the other references: scored once before training, and LoRA's base with its adapters off (with and without)
    for name, extra in (("precomputed", ["dpo.precompute_ref_log_probs=true"]),
                        ("lora", ["model.lora.rank=4", "dpo.ref_model.path=null"]),
                        ("lora precomputed", ["model.lora.rank=4", "dpo.ref_model.path=null",
                                              "dpo.precompute_ref_log_probs=true"])):
        trainer = DPOTrainer(dpo_config(folder, "sigmoid", "shared", *extra), info)
        out[name] = _first_step(trainer) | {"holds_reference": trainer.reference is not None}
        trainer.logs.close()
    torch.distributed.barrier()
    return out
