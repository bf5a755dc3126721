"""Inputs as users bring them: left-padded rows, learned absolute positions (GPT-2), all-padding rows,
per-token outputs, a token cap under left padding -- one process, no process group."""

from __future__ import annotations

import pytest
import torch

from numerics import FP32_RTOL, assert_close
from syncwise.config import load_config
from syncwise.data.batching import split_batch
from syncwise.data.partition import token_cost
from syncwise.engine import Engine
from syncwise.losses import LossOutput, sft_loss


def _engine(*overrides: str, model=None) -> Engine:
    cfg = load_config(None, ["engine.strategy=none", "model.preset=qwen2-test", "optim.name=sgd", *overrides])
    return Engine(cfg, model)


def _padded(lengths: list[int], width: int | None = None, vocab: int = 512, seed: int = 0,
                 side: str = "left") -> dict:
    width = width or max(lengths)
    gen = torch.Generator().manual_seed(seed)
    columns, lengths = torch.arange(width)[None], torch.tensor(lengths)[:, None]
    mask = (columns >= width - lengths if side == "left" else columns < lengths).long()
    return {"input_ids": torch.randint(1, vocab, (len(lengths), width), generator=gen) * mask, "attention_mask": mask}


def _alone_log_probs(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    """Each sequence's next-token log-probs computed on it alone (no padding at all)."""
    out = []
    with torch.no_grad():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            seq = ids[mask.bool()][None]
            logp = torch.log_softmax(model(input_ids=seq).logits[0, :-1].float(), -1)
            out.append(logp.gather(-1, seq[0, 1:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("packing", ["false", "true"])
def test_padded_rows_train_on_their_real_targets_only(packing):
    """Rows of 8 / 5 / 3 real tokens, left-padded, no loss_mask: the loss is the mean over the 13 real
    targets, padded and packed alike (a "padding -> first token" target used to be counted)."""
    engine = _engine(f"engine.packing={packing}")
    batch = _padded([8, 5, 3])
    alone = _alone_log_probs(engine.model, batch)
    expected = -torch.cat(alone).sum() / 13
    loss = engine.eval_batch(batch, sft_loss).metrics["loss"]
    assert loss == pytest.approx(float(expected), rel=FP32_RTOL)
    log_probs = engine.forward_batch(batch).outputs["log_probs"]  # [B, T-1] at the batch's own columns
    for row, (lengths, lp) in enumerate(zip((8, 5, 3), alone, strict=True)):
        assert_close(log_probs[row, 8 - lengths :], lp, what=f"row {row}")
        if packing == "true":  # no target there (the padded path writes what the model says of padding)
            assert (log_probs[row, : 8 - lengths] == 0).all()


def _gpt2(n_positions: int = 16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()


def test_learned_positions_see_a_padded_row_as_alone():
    model = _gpt2()
    engine = _engine("engine.packing=false", model=model)
    batch = _padded([12, 4, 7], width=12)
    log_probs = engine.forward_batch(batch).outputs["log_probs"]
    for row, (length, lp) in enumerate(zip((12, 4, 7), _alone_log_probs(model, batch), strict=True)):
        assert_close(log_probs[row, 12 - length :], lp, what=f"row {row}")


def test_a_batch_wider_than_the_positions_of_shorter_sequences_runs():
    """20 columns of left-padded sequences of at most 16 tokens on n_positions=16: each sequence fits."""
    engine = _engine("engine.packing=false", model=_gpt2(n_positions=16))
    batch = _padded([16, 9, 3], width=20)
    metrics = engine.train_batch(batch, sft_loss)
    assert metrics["batch/real_tokens"] == 28


def test_token_cap_holds_for_left_padding_and_computed_tokens_are_true():
    lengths = [100, 10, 10, 10, 10]
    batch = _padded(lengths)
    micro = split_batch(batch, 2, max_tokens=100, packed=False)
    assert sorted(tuple(mb.data["input_ids"].shape) for mb in micro) == [(1, 100), (4, 10)]
    assert all(mb.data["input_ids"].numel() <= 100 for mb in micro)
    assert sum(token_cost([lengths[i] for i in mb.indices.tolist()], packed=False) for mb in micro) == 140
    metrics = _engine("engine.packing=false", "engine.max_tokens_per_micro_batch=100").train_batch(batch, sft_loss)
    assert metrics["batch/computed_tokens"] == 140 and metrics["train/num_microbatches"] == 2


@pytest.mark.parametrize("packing", ["false", "true"])
def test_an_all_padding_row_under_a_token_cap_trains_like_the_batch_without_it(packing):
    batch = _padded([5, 3, 5])  # two rows fill two micro-batches: the empty one leads a third
    batch["attention_mask"][1] = 0
    batch["input_ids"][1] = 0
    overrides = (f"engine.packing={packing}", "engine.max_tokens_per_micro_batch=8")
    with_empty = _engine(*overrides).train_batch(batch, sft_loss)
    without = _engine(*overrides).train_batch({k: v[[0, 2]] for k, v in batch.items()}, sft_loss)
    assert with_empty["loss"] == pytest.approx(without["loss"], rel=FP32_RTOL)


def _per_token_and_target(outputs, micro_batch, norm) -> LossOutput:
    """A loss whose outputs are per token ([b, w]: the first logit) and per target ([b, w-1])."""
    first_logit = outputs.logits[..., 0].float()
    loss = sft_loss(outputs, micro_batch, norm)
    loss.outputs.update(first_logit=first_logit.detach(), first_logit_of_targets=first_logit[:, :-1].detach())
    return loss


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("packing", ["false", "true"])
def test_per_token_outputs_come_back_full_width_at_their_columns(packing, padding):
    engine = _engine(f"engine.packing={packing}", "engine.micro_batch_size=2")
    batch = _padded([6, 2, 4, 3], width=9, side=padding)
    outputs = engine.forward_batch(batch, _per_token_and_target).outputs
    assert outputs["first_logit"].shape == (4, 9) and outputs["first_logit_of_targets"].shape == (4, 8)
    with torch.no_grad():
        for row in range(4):
            mask = batch["attention_mask"][row].bool()
            alone = engine.model(input_ids=batch["input_ids"][row][mask][None]).logits[0, :, 0]
            assert_close(outputs["first_logit"][row][mask], alone, what=f"row {row}")


def test_resumed_auto_state_is_restored_only_where_it_can_run(capsys):
    """An auto decision saved by an FSDP2 run (deferred_unsharded) resumed where that mode cannot run: auto
    decides again (measuring in per_microbatch first) and says so; where it can run, it is restored."""
    from syncwise.sync.modes import SyncMode

    saved = {"step": 3, "skipped_steps": 0, "scheduler": None, "active_mode": "deferred_unsharded",
             "active_units": [], "base_peak": 1000}
    engine = _engine("sync.mode=auto")
    assert SyncMode.DEFERRED_UNSHARDED not in engine.supported_modes
    engine.load_engine_state(saved)
    assert engine.active_mode.mode is SyncMode.PER_MICROBATCH and engine.step == 3
    assert "cannot run here (engine.strategy=none); sync.mode=auto decides again" in capsys.readouterr().out
    explicit = _engine("sync.mode=per_microbatch")
    explicit.load_engine_state({**saved, "active_mode": "per_microbatch"})
    assert explicit.active_mode.mode is SyncMode.PER_MICROBATCH and explicit.governor.base_peak == 1000
