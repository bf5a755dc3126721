"""Run on gloo ranks by test_sequence_parallel.py: the engine under ``dist.sequence_parallel`` -- each packed row
split across a group of ranks, attention's heads exchanged -- against one plain process on every rank's rows at
once: per-token log-probs (or a critic's values), the loss and every parameter's gradient."""

from __future__ import annotations

import torch

from scenarios import full_grads
from syncwise.config import PolicyLossConfig, load_config
from syncwise.engine import Engine
from syncwise.losses import Normalizer, make_sft_loss, target_mask, token_log_probs
from syncwise.models import build_model, value_head_of
from syncwise.rl.algorithm.losses import make_policy_loss, make_value_loss
from syncwise.sync.counting import count_collectives

IDS = 100  # token ids below every test model's vocabulary
# each rank's row lengths: no group size divides them, so packed rows cross shard borders and end padded
LENGTHS = [[13, 6, 9], [11, 3, 7], [5, 12, 8], [9, 9, 4]]
WIDTH = 14


def rows_of(rank: int) -> dict[str, torch.Tensor]:
    """Right-padded rows, the loss on all but each row's first two tokens; what the RL losses read beside them."""
    gen = torch.Generator().manual_seed(300 + rank)
    lengths = LENGTHS[rank]
    ids = torch.randint(1, IDS, (len(lengths), WIDTH), generator=gen)
    mask = (torch.arange(WIDTH)[None] < torch.tensor(lengths)[:, None]).long()
    loss_mask = mask.clone()
    loss_mask[:, :2] = 0
    targets = (len(lengths), WIDTH - 1)
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss_mask,
            "advantages": torch.randn(len(lengths), generator=gen),
            "old_log_probs": -torch.rand(targets, generator=gen) * 6,  # far from the model's: ratios get clipped
            "returns": torch.randn(targets, generator=gen), "values": torch.randn(targets, generator=gen) * 0.1}


def loss_of(kind: str):
    """sft:<agg> | ppo:<agg> (GRPO's clipped loss, an entropy bonus) | gspo:<agg> | value (PPO's critic)."""
    name, _, agg = kind.partition(":")
    if name == "sft":
        return make_sft_loss(agg)
    if name == "value":
        return make_value_loss()
    return make_policy_loss(PolicyLossConfig(kind=name, agg=agg, entropy_coef=0.01 if name == "ppo" else 0.0))


def case_config(model: str, size: int, *extra: str):
    return load_config(None, [model, "engine.strategy=fsdp2", "sync.mode=deferred", f"dist.sequence_parallel={size}",
                              "engine.micro_batch_size=4", "engine.max_tokens_per_micro_batch=0", "optim.name=sgd",
                              "optim.lr=0", "optim.grad_clip=0", "model.dropout=off", *extra])


def _model(config, kind: str):
    model = build_model(config.model, value_head=kind == "value")
    if kind == "value":  # a critic's head starts at zero: drawn here, so its values and their gradient are seen
        with torch.no_grad():
            torch.manual_seed(5)
            value_head_of(model).weight.normal_(0, 0.5)
    return model


def sequence_parallel_step(info, model: str, size: int, kind: str, extra: tuple[str, ...] = ()) -> dict:
    """One forward-backward of ``kind``'s loss on this rank's rows with ``dist.sequence_parallel=size``:
    gradients, its rows' log-probs (a critic: values), the loss and the step's collectives."""
    config = case_config(model, size, *extra)
    engine = Engine(config, _model(config, kind), info)
    batch = rows_of(info.rank)
    with count_collectives() as counts:
        result = engine.forward_backward_batch(batch, loss_of(kind))
    # the update's own log-probs (a critic: values) where its loss returns them, else a forward pass's
    values = result.outputs.get("values", result.outputs.get("log_probs"))
    return {"grads": full_grads(engine), "loss": result.metrics["loss"], "counts": dict(counts.counts),
            "values": values if values is not None else engine.forward_batch(batch).outputs["log_probs"],
            "microbatches": result.num_microbatches, "layers": engine.features.hf_config.num_hidden_layers}


def reference(model: str, world: int, kind: str, extra: tuple[str, ...] = ()) -> dict:
    """The same on one plain process over every rank's rows."""
    config = case_config(model, 1, *extra)
    net = _model(config, kind)
    parts = [rows_of(r) for r in range(world)]
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    out = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    mask = target_mask(batch)
    norm = Normalizer(tokens=float(mask.sum()), sequences=float((mask.sum(1) > 0).sum()), dp_size=1,
                      max_target_len=float(mask.sum(1).max()))
    loss = loss_of(kind)(out, batch, norm)
    loss.loss.backward()
    real = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).bool()
    if kind == "value":
        values = out.logits[:, :-1, 0].detach() * real
    else:
        values = token_log_probs(out.logits.detach(), batch["input_ids"]) * real
    rows = [len(LENGTHS[r]) for r in range(world)]
    return {"grads": {n: p.grad for n, p in net.named_parameters()}, "values": values.split(rows),
            "loss": float(loss.metrics["loss"])}


def sequence_parallel_suite(info, cases: dict) -> dict:
    """Every case on this process group; rank 0 adds each case's single-process reference. On 2 ranks, also what
    each raises when their batches do not join (:func:`keys_that_do_not_join`)."""
    out = {}
    for name, (model, size, kind, extra) in cases.items():
        out[name] = sequence_parallel_step(info, model, size, kind, extra)
        if info.rank == 0:
            out[name]["reference"] = reference(model, info.world_size, kind, extra)
    if info.world_size == 2:
        out["keys that do not join"] = keys_that_do_not_join(info)
    return out


def resume_across_sizes(info, folder: str) -> dict:
    """Two SGD steps of SFT at N = 1, and the same two with the first at N = 2, checkpointed (DCP) and resumed by
    an engine at N = 1 for the second: the parameters after each (FSDP shards over every rank whatever N is)."""
    from scenarios import full_params
    from syncwise.checkpoint import CheckpointManager
    from syncwise.losses import sft_loss

    def engine(size: int) -> Engine:
        config = case_config("model.preset=qwen2-test", size, "optim.lr=0.5")  # SGD: linear in the gradients
        return Engine(config, build_model(config.model), info)

    first, second = rows_of(info.rank), rows_of(info.rank + 2)
    whole = engine(1)
    whole.train_batch(first, sft_loss)
    whole.train_batch(second, sft_loss)
    split = engine(2)
    split.train_batch(first, sft_loss)
    saved = CheckpointManager(folder).save(1, split, {"step": 1})
    resumed = engine(1)
    CheckpointManager(folder).load(saved, resumed)
    resumed.train_batch(second, sft_loss)
    return {"whole": full_params(whole), "resumed": full_params(resumed), "steps": resumed.step}


def keys_that_do_not_join(info) -> str:
    """Rank 1 gives a key fewer than rank 0 in one sequence-parallel group: what each rank raises (no rank left
    waiting in a collective)."""
    from syncwise.data.batching import BatchError

    config = case_config("model.preset=qwen2-test", 2)
    engine = Engine(config, build_model(config.model), info)
    batch = rows_of(info.rank)
    if info.rank == 1:
        del batch["returns"]
    try:
        engine.forward_backward_batch(batch, make_sft_loss("token-mean"))
    except BatchError as exc:
        return str(exc)
    return "nothing raised"
