"""Run on 2 gloo ranks by test_sft.py: one SFT step of chat rows (the arith_chat task's tokenizer and
template), packed and padded, against a single-process full-batch reference."""

from __future__ import annotations

import torch

from scenarios import engine_config, full_grads
from syncwise.data.sft_dataset import SampleOrder, padded_batch, rank_share, rows_dataset, tokenize_dataset
from syncwise.engine import Engine
from syncwise.losses import Normalizer, sft_loss, target_mask
from syncwise.models import build_model
from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer

BATCH = 8


def chat_data():
    rows = arith_chat_rows(40, seed=4)
    tokenizer = chat_tokenizer(rows)
    data = tokenize_dataset(rows_dataset([{"messages": r["messages"]} for r in rows]), "chat", tokenizer, 512,
                            "right", "error")
    return tokenizer, data


def _config(packing: bool):
    return engine_config("fsdp2", "deferred", "model.preset=llama-test", f"engine.packing={packing}")


def sft_suite(info) -> dict:
    tokenizer, data = chat_data()
    samples, _ = SampleOrder(data.lengths, seed=0).step(0, BATCH, 0, info.world_size)
    mine = rank_share(samples, data.lengths, info.rank, info.world_size)
    out = {"samples": samples, "mine": mine}
    for packing in (True, False):
        cfg = _config(packing)
        engine = Engine(cfg, build_model(cfg.model, vocab_size=len(tokenizer)), info)
        engine.forward_backward_batch(padded_batch(data, mine, tokenizer.pad_token_id), sft_loss)
        out["packed" if packing else "padded"] = full_grads(engine)
    if info.rank == 0:
        model = build_model(_config(False).model, vocab_size=len(tokenizer))
        batch = padded_batch(data, samples, tokenizer.pad_token_id)
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        mask = target_mask(batch)
        norm = Normalizer(tokens=float(mask.sum()), sequences=float((mask.sum(1) > 0).sum()), dp_size=1)
        sft_loss(outputs, batch, norm).loss.backward()
        out["reference"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.distributed.barrier()
    return out
