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
from syncwise.losses.preference import coefficient_loss

LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
# each layout in another sync mode; 3 rows a micro-batch: a pair split across two (the coefficients make it exact)
LAYOUTS = {"shared": ["engine.packing=true", "engine.share_prefixes=true", "sync.mode=deferred"],
           "packed": ["engine.packing=true", "engine.share_prefixes=false", "sync.mode=per_microbatch"],
           "padded": ["engine.packing=false", "sync.mode=deferred_unsharded"]}


def dpo_config(folder: Path, loss: str, layout: str, *extra: str):
    reference = [] if loss == "simpo" else [f"dpo.ref_model.path={folder / 'reference'}"]
    smoothing = ["dpo.label_smoothing=0.2"] if loss in ("robust", "simpo") else []
    return load_config(None, [
        f"model.path={folder / 'llama'}", f"dpo.dataset={folder / 'pairs.jsonl'}", f"dpo.loss_type={loss}",
        "dpo.batch_size=6", "dpo.beta=0.5", f"dpo.out_dir={folder / 'runs' / loss / layout}", "dpo.progress=false",
        "dpo.export=false", "engine.micro_batch_size=3", "engine.max_tokens_per_micro_batch=0",
        "engine.fused_lm_head=false", "optim.name=sgd", "optim.lr=0", "optim.grad_clip=0",
        *reference, *smoothing, *LAYOUTS[layout], *extra])


def _first_step(trainer: DPOTrainer) -> dict:
    """The step's pairs, the reduced scores and the full gradient of the coefficient loss (the gradient zeroed after:
    the trainer serves the next loss)."""
    pairs, batch, scores, _ = trainer.prepare()
    trainer.engine.forward_backward_batch(batch, coefficient_loss)
    out = {"pairs": pairs, "scores": trainer.reduce(scores, len(pairs)), "grads": full_grads(trainer.engine)}
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
