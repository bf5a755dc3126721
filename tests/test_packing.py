"""Sequence packing: the layout (unit), the model keeps packed sequences apart (real HF models), and on 2
gloo ranks packed micro-batches give the padded path's gradients for SFT and every policy loss and
aggregation mode, the same per-sample log-probs, and micro-batches within the token cap."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from numerics import FP32_RTOL, assert_close
from scenarios import _clean
from scenarios_batching import PACKING_KINDS, ROLLOUT_IS_CASES, SIZES, grpo_batch, packing_suite, skewed_batch
from syncwise.config import AGG_MODES, ModelConfig
from syncwise.data.packing import pack, packable, packs_correctly, unpack
from syncwise.models import build_model


def test_pack_lays_every_tensor_along_one_row_and_unpacks():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    mask = (ids > 0).long()
    per_target = torch.arange(9.0).view(3, 3)
    packed, packing = pack({"input_ids": ids, "attention_mask": mask, "old": per_target,
                            "adv": torch.tensor([1.0, 2.0, 3.0])})
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packed["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 0, 1, 1, 1]]  # no target across a boundary
    assert packed["old"].tolist() == [[0.0, 1.0, 0.0, 3.0, 0.0, 6.0, 7.0, 8.0]]
    assert packed["adv"].tolist() == [[1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0]]
    assert packed["target_sequence"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert "attention_mask" not in packed
    assert unpack(packed["old"], packing).tolist() == [[0.0, 1.0, 0.0], [3.0, 0.0, 0.0], [6.0, 7.0, 8.0]]
    assert torch.equal(unpack(packed["input_ids"], packing), ids)


def test_left_padding_packs_too_and_gaps_do_not():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    packed, _ = pack({"input_ids": ids, "attention_mask": (ids > 0).long()})
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]]
    holes = {"input_ids": ids, "attention_mask": torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])}
    assert "gaps" in packable(holes)
    odd = {"input_ids": ids, "scores": torch.zeros(2, 7)}
    assert "cannot be packed" in packable(odd)


@pytest.mark.parametrize("preset", ["qwen2-test", "llama-test"])
def test_packed_logits_of_each_sequence_equal_its_unpacked_logits(preset):
    model = build_model(ModelConfig(preset=preset)).eval()
    seqs = [torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12, 3)]
    batch = {"input_ids": torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)}
    batch["attention_mask"] = (torch.arange(12)[None] < torch.tensor([7, 12, 3])[:, None]).long()
    packed, packing = pack(batch)
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        padded = unpack(logits, packing)
        for i, seq in enumerate(seqs):
            alone = model(input_ids=seq[None], use_cache=False).logits[0]
            assert_close(padded[i, : len(seq)], alone, what=f"sequence {i}")
    assert packs_correctly(type(model), model.config.to_json_string(), "sdpa") is None


def test_a_model_that_cannot_pack_gets_a_message_and_the_padded_path():
    from torch import nn

    from syncwise.config import load_config
    from syncwise.engine import Engine

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return type("Out", (), {"logits": self.embed(input_ids)})()

    with pytest.warns(RuntimeWarning, match="engine.packing: Plain is not a Hugging Face model"):
        engine = Engine(load_config(None, ["engine.strategy=none"]), Plain())
    assert engine.features.packing is False


@pytest.fixture(scope="module")
def results():
    return run_distributed(packing_suite, 2)


def _close(a: dict, b: dict) -> None:
    for name in a:
        assert_close(a[name], b[name], what=_clean(name))


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("kind", PACKING_KINDS)
def test_packed_gradients_equal_the_padded_path(results, kind, agg):
    packed, padded = results[0][(kind, agg, "true")], results[0][(kind, agg, "false")]
    _close(packed["grads"], padded["grads"])
    assert packed["loss"] == pytest.approx(padded["loss"], rel=FP32_RTOL)  # ~20: one fp32 ulp is 1.9e-6


def test_per_sample_log_probs_come_back_in_order(results):
    """Where a target exists (a real token predicting a real token) packed and padded log-probs agree; the
    packed path writes 0 elsewhere, the padded one whatever the model says about padding."""
    for rank, r in enumerate(results):
        mask = skewed_batch(rank, SIZES[rank])["attention_mask"]
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        for packed, padded in ((r[("eval", "true")], r[("eval", "false")]),
                               (r[("ppo", "token-mean", "true")]["log_probs"],
                                r[("ppo", "token-mean", "false")]["log_probs"])):
            assert packed.shape == padded.shape
            assert_close(packed[valid], padded[valid], what="log-probs")
            assert (packed[~valid] == 0).all()


def test_packing_computes_no_padding(results):
    for r in results:
        packed, padded = r[("step", "true")], r[("step", "false")]
        assert packed["batch/padding_fraction"] == 0.0 < padded["batch/padding_fraction"]
        assert packed["batch/real_tokens"] == padded["batch/real_tokens"]
        assert packed["train/num_microbatches"] <= padded["train/num_microbatches"]
        for m in (packed, padded):
            assert m["comm/reduce_scatter_count"] == m["comm/expected_reduce_scatter_count"]


@pytest.mark.parametrize("mode", ["per_microbatch", "deferred", "deferred_unsharded"])
def test_activation_checkpointing_keeps_gradients_and_lowers_the_peak(results, mode):
    off, on = results[0]["checkpointing"][(mode, "false")], results[0]["checkpointing"][(mode, "true")]
    _close(on["grads"], off["grads"])
    assert on["peak"] < off["peak"]
    for m in (on["metrics"], off["metrics"]):
        assert m["comm/all_gather_count"] == m["comm/expected_all_gather_count"]


def test_a_sequence_longer_than_the_model_allows_is_named():
    from syncwise.config import load_config
    from syncwise.data.batching import BatchError
    from syncwise.engine import Engine
    from syncwise.losses import sft_loss

    engine = Engine(load_config(None, ["engine.strategy=none", "model.preset=qwen2-test"]))
    lengths = torch.tensor([10, 600, 20])
    ids = torch.randint(1, 500, (3, 600))
    mask = (torch.arange(600)[None] < lengths[:, None]).long()
    with pytest.raises(BatchError, match="batch: sample 1 has 600 tokens, more than the model's "
                                         "max_position_embeddings=512"):
        engine.train_batch({"input_ids": ids * mask, "attention_mask": mask}, sft_loss)


@pytest.mark.parametrize(("level", "agg"), ROLLOUT_IS_CASES)
def test_rollout_importance_correction_packed_equals_padded(results, level, agg):
    packed, padded = results[0][("is", level, agg, "true")], results[0][("is", level, agg, "false")]
    _close(packed["grads"], padded["grads"])
    for key in ("loss", "rollout/is_weight_mean", "rollout/is_capped_fraction", "rollout/is_weight_max"):
        assert packed["metrics"][key] == pytest.approx(padded["metrics"][key], rel=FP32_RTOL), key
    assert 0 < packed["metrics"]["rollout/is_capped_fraction"] < 1  # the synthetic mismatch hits the cap
    assert packed["metrics"]["rollout/is_weight_max"] == pytest.approx(1.5)


def test_the_packing_check_shrinks_gpt2_style_configs():
    """A gpt2-medium-shaped config is checked on one narrow layer, not built at full size on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from syncwise.models import one_small_layer

    medium = GPT2Config(n_layer=24, n_embd=1024, n_head=16)
    small = one_small_layer(medium.to_dict())
    assert (small["n_layer"], small["n_embd"], small["n_head"], small["n_inner"]) == (1, 64, 4, 128)
    assert packs_correctly(GPT2LMHeadModel, medium.to_json_string(), "sdpa") is None


def test_a_sliding_window_is_honoured_when_packed():
    """Mistral with a window shorter than the check's sequences: the packed row gives each sequence the
    logits it has alone (sdpa_varlen applies the window), so packing stays on."""
    from transformers import MistralConfig, MistralForCausalLM

    from syncwise.data import attention

    attention.register()
    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=3)
    assert packs_correctly(MistralForCausalLM, config.to_json_string(), attention.NAME) is None
    torch.manual_seed(0)
    config._attn_implementation = attention.NAME
    model = MistralForCausalLM(config).eval()
    seqs = [torch.randint(1, 512, (n,)) for n in (9, 2, 6)]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        packed = model(input_ids=torch.cat(seqs)[None], position_ids=positions,
                       **attention.sequence_bounds(positions)).logits[0]
    for part, reference in zip(packed.split([9, 2, 6]), alone, strict=True):
        assert_close(part, reference)


@pytest.fixture
def kernel_choice():
    from syncwise.data import attention

    yield attention
    attention.choose_kernel(torch.device("cpu"), torch.float32)  # back to this process's loop


def test_the_packed_attention_kernel_is_chosen_once_with_a_line_saying_which(kernel_choice, monkeypatch):
    """CPU or fp32: the per-sequence loop; CUDA with bf16 / fp16: torch's varlen_attn, else flash-attention's,
    else the loop -- each choice said in one line, once per process."""
    attention = kernel_choice
    cuda = torch.device("cuda")
    kernel, line = attention.choose_kernel(cuda, torch.float32)
    assert kernel == "loop" and "need bf16 / fp16 compute, not float32" in line
    assert attention.choose_kernel(cuda, torch.float32) == ("loop", None)  # said already
    kernel, line = attention.choose_kernel(cuda, torch.bfloat16)
    repeat = "" if attention.takes_gqa(attention._torch_varlen()) else (
        "; key / value heads repeated for grouped-query models (this torch's takes no enable_gqa)")
    assert (kernel, line) == ("varlen_attn", "packed attention: varlen_attn (torch.nn.attention.varlen, one kernel "
                                             f"per packed row{repeat})")
    monkeypatch.setattr(attention, "_torch_varlen", lambda: None)
    monkeypatch.setattr(attention, "_flash_attn_varlen", lambda: object())
    assert attention.choose_kernel(cuda, torch.float16)[0] == "flash_attn"
    monkeypatch.setattr(attention, "_flash_attn_varlen", lambda: None)
    assert attention.choose_kernel(cuda, torch.bfloat16)[0] == "loop"
    kernel, line = attention.choose_kernel(torch.device("cpu"), torch.bfloat16)
    assert kernel == "loop" and line == "packed attention: loop (no variable-length kernel on cpu)"
    assert attention.current_kernel() == "loop"


def _per_sequence(query, key, value, cu_seq_q, window_size, scale):
    import torch.nn.functional as F

    left = window_size[0]
    outs = []
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
        offsets = torch.arange(end - start)
        distance = offsets[:, None] - offsets[None, :]
        mask = (distance >= 0) & ((distance <= left) if left >= 0 else True)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1))
    return torch.cat(outs)


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """torch 2.11's ``varlen_attn`` signature exactly (no ``enable_gqa``: equal heads only), computed per sequence
    with sdpa -- a CUDA kernel's stand-in that pins how syncwise calls it."""
    assert query.shape[1] == key.shape[1] == value.shape[1], "2.11's kernel takes equal heads"
    return _per_sequence(query, key, value, cu_seq_q, window_size, scale)


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's signature: ``enable_gqa`` maps the query heads to fewer key / value heads."""
    assert enable_gqa == (query.shape[1] != key.shape[1])
    return _per_sequence(query, key, value, cu_seq_q, window_size, scale)


@pytest.mark.parametrize("kernel", [varlen_attn_2_11, varlen_attn_2_13])
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_attn_is_called_as_the_installed_torch_takes_it(kernel_choice, monkeypatch, kernel, window):
    """Issue 59: torch 2.11's varlen_attn takes no ``enable_gqa``; its signature is read at the choice and a
    grouped-query model (4 query heads, 2 key / value heads) gets its key / value heads repeated -- the packed row's
    attention equals the per-sequence loop's either way."""
    attention = kernel_choice
    monkeypatch.setattr(attention, "_torch_varlen", lambda: kernel)
    chosen, line = attention.choose_kernel(torch.device("cuda"), torch.bfloat16)
    assert chosen == "varlen_attn" and ("repeated" in line) == (kernel is varlen_attn_2_11)
    gen = torch.Generator().manual_seed(3)
    lengths = [7, 2, 11]
    query = torch.randn(1, 4, sum(lengths), 16, generator=gen).bfloat16()
    key, value = (torch.randn(1, 2, sum(lengths), 16, generator=gen).bfloat16() for _ in range(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    bounds = attention.sequence_bounds(positions)
    module = torch.nn.Module().eval()
    one, _ = attention.varlen_sdpa_attention(module, query, key, value, None, scaling=0.25, sliding_window=window,
                                             **bounds)
    monkeypatch.setattr(attention, "_kernel", "loop")
    loop, _ = attention.varlen_sdpa_attention(module, query, key, value, None, scaling=0.25, sliding_window=window,
                                              **bounds)
    assert one.shape == loop.shape == (1, sum(lengths), 4, 16)
    assert_close(one.float(), loop.float(), rtol=2e-2, what="one kernel vs the loop")  # bf16 outputs


def test_masked_grouped_query_attention_equals_transformers_sdpa():
    """The samplers' padded prefill and decode of a grouped-query model go through sdpa's own enable_gqa on CPU
    (transformers would copy the keys and values per query head): the same attention, within fp32 rounding."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from syncwise.data.attention import varlen_sdpa_attention

    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    generator = torch.Generator().manual_seed(0)
    for queries, keys in ((7, 7), (1, 23)):  # a left-padded prefill, a decode step on a cache
        q = torch.randn(3, 4, queries, 16, generator=generator)
        k, v = (torch.randn(3, 2, keys, 16, generator=generator) for _ in range(2))
        mask = torch.ones(3, 1, queries, keys, dtype=torch.bool).tril(diagonal=keys - queries)
        mask[1, :, :, :3] = False  # row 1 left-padded
        mask[1, :, :3, 2] = True  # (a fully masked query row would be NaN either way)
        ours, _ = varlen_sdpa_attention(module, q, k, v, mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
        assert ours.shape == theirs.shape == (3, queries, 4, 16)
        assert_close(ours, theirs, rtol=FP32_RTOL)


# ----- shared prefixes: rows that begin alike compute their common start once -----

@pytest.fixture
def small_prefixes(monkeypatch):
    """Hand-sized rows: share from 2 common tokens (the engine waits for MIN_SHARED)."""
    monkeypatch.setattr("syncwise.data.prefixes.MIN_SHARED", 2)


def test_rows_that_begin_alike_read_their_start_from_an_earlier_row(small_prefixes):
    from syncwise.data.prefixes import prefix_segments, shared_prefixes

    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6],   # system 1 2, prompt 3 4, response 5 6 (left-padded)
                        [1, 2, 3, 4, 7, 8, 0],   # the same prompt
                        [1, 2, 9, 9, 9, 5, 0],   # the same system prompt only
                        [1, 2, 9, 9, 9, 6, 6],   # the third row's prompt
                        [4, 4, 4, 0, 0, 0, 0]])  # nothing in common
    mask = (ids > 0).long()
    mask[0, 0] = 0
    loss = torch.zeros_like(ids)
    loss[0, 5:], loss[1, 4:6], loss[2, 5], loss[3, 5:], loss[4, 2] = 1, 1, 1, 1, 1
    leader, shared, whole = shared_prefixes(ids, mask.bool(), loss)
    # a row never reads its first target's previous token: its logits predict its own first response token
    assert leader.tolist() == [-1, 0, 0, 2, -1]
    assert shared.tolist() == [0, 3, 2, 4, 0]
    assert whole.tolist() == [False, True, False, True, False]
    packed, packing = pack({"input_ids": ids, "attention_mask": mask, "loss_mask": loss}, share_prefixes=True)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 4, 7, 8, 9, 9, 9, 5, 9, 6, 6, 4, 4, 4]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 5, 2, 3, 4, 5, 4, 5, 6, 0, 1, 2]]
    assert packed["loss_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 1]]
    inputs = packing.attention_inputs()
    assert inputs["cu_seq_lens_q"].tolist() == [0, 6, 9, 13, 16, 19]
    # the fourth row reads its start from the third, which reads the system prompt from the first
    assert inputs["shared_prefix"] == [[], [(0, 3)], [(0, 2)], [(0, 2), (9, 2)], []]
    assert prefix_segments(leader, shared, [0, 6, 9, 13, 16]) == inputs["shared_prefix"]
    unpacked = unpack(packed["input_ids"], packing)
    assert unpacked[1].tolist() == [0, 0, 0, 4, 7, 8, 0]  # the start it read is not its own output


def test_without_a_loss_mask_or_a_common_start_nothing_is_shared():
    from syncwise.data.prefixes import shared_prefixes

    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    assert shared_prefixes(ids, mask, None)[1].tolist() == [0, 0]  # every token is a target (SFT)
    packed, packing = pack({"input_ids": ids, "attention_mask": mask.long()}, share_prefixes=True)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 1, 2, 3, 5]]
    assert "shared_prefix" not in packing.attention_inputs()


def _gpt2(dropout: float):
    """GPT-2 (Conv1D, learned positions, dropout) as transformers builds it, tiny."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def _mistral_windowed():
    """Mistral with a sliding window (5) shorter than the rows: followers' attention gets the window's mask."""
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            sliding_window=5, attn_implementation="sdpa"))


@pytest.mark.parametrize("preset", ["qwen2-test", "llama-test", "gpt2", "mistral, window 5"])
def test_a_shared_prompt_gives_each_row_its_logits_alone(preset, small_prefixes):
    from syncwise.data import attention
    from syncwise.data.prefixes import shares_correctly

    torch.manual_seed(0)
    built = {"gpt2": lambda: _gpt2(0.0), "mistral, window 5": _mistral_windowed}
    model = (built[preset]() if preset in built else build_model(ModelConfig(preset=preset))).eval()
    attention.register()
    model.set_attn_implementation(attention.NAME)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 500, (9,), generator=gen)
    rows = [torch.cat([prompt, torch.randint(1, 500, (n,), generator=gen)]) for n in (4, 6, 2)]
    width = max(len(r) for r in rows)
    batch = {"input_ids": torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])}
    batch["attention_mask"] = (batch["input_ids"] > 0).long()
    batch["loss_mask"] = batch["attention_mask"].clone()
    batch["loss_mask"][:, :9] = 0
    packed, packing = pack(batch, share_prefixes=True)
    assert packed["input_ids"].shape[1] == sum(len(r) for r in rows) - 2 * 8
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False,
                       **packing.attention_inputs()).logits
        padded = unpack(logits, packing)
        for i, row in enumerate(rows):
            alone = model(input_ids=row[None], use_cache=False).logits[0]
            first = 0 if i == 0 else 8  # followers compute from the prompt's last token on
            assert_close(padded[i, first:len(row)], alone[first:], what=f"row {i}")
    assert shares_correctly(type(model), model.config.to_json_string()) is None


def test_a_model_that_drops_out_does_not_share():
    from syncwise.config import load_config
    from syncwise.engine.features import model_features

    cfg = load_config(None, ["engine.strategy=none"])
    features = model_features(_gpt2(0.1), cfg, torch.device("cpu"), say=False)
    assert features.packing and not features.share_prefixes
    assert model_features(_gpt2(0.0), cfg, torch.device("cpu"), say=False).share_prefixes


def test_auto_shares_beside_the_per_sequence_loop_and_true_also_in_place_of_a_varlen_kernel(capsys):
    from syncwise.config import ConfigError, load_config
    from syncwise.engine.features import _sharing_works, model_features

    model = _gpt2(0.0)
    cfg = load_config(None, ["engine.strategy=none"])
    model_features(model, cfg, torch.device("cpu"), say=False)  # packs: its attention becomes syncwise's
    assert _sharing_works(model, model.config, "auto", "loop", say=True)
    assert not _sharing_works(model, model.config, "auto", "varlen_attn", say=True)
    assert "engine.share_prefixes: off (auto keeps the varlen_attn kernel" in capsys.readouterr().out
    assert _sharing_works(model, model.config, True, "varlen_attn", say=True)
    assert not _sharing_works(model, model.config, False, "loop", say=True)
    with pytest.raises(ConfigError, match="engine.share_prefixes: expected true, false or auto"):
        load_config(None, ["engine.share_prefixes=sometimes"])


@pytest.mark.parametrize("split", ["two rows a micro-batch", "token cap 80", "token cap 200"])
@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_shared_prefixes_give_the_unshared_gradients_with_fewer_tokens(results, split, kind):
    for rank, r in enumerate(results):
        runs = {k[2:]: v for k, v in r["shared"].items() if k[:2] == (split, kind)}
        shared, packed, padded = runs[("true", "true")], runs[("false", "true")], runs[("false", "false")]
        assert shared["shares"] and not packed["shares"]
        for other in (packed, padded):
            _close(shared["grads"], other["grads"])
            assert shared["loss"] == pytest.approx(other["loss"], rel=1e-5, abs=1e-6)
        mask = grpo_batch(rank)["loss_mask"][:, 1:].bool()  # targets: the responses' tokens
        assert_close(shared["log_probs"][mask], packed["log_probs"][mask], what="log-probs")
        assert shared["metrics"]["batch/real_tokens"] == packed["metrics"]["batch/real_tokens"]
        assert shared["metrics"]["batch/computed_tokens"] < packed["metrics"]["batch/computed_tokens"]
        m = shared["metrics"]  # packed: every real token computed or read from a shared start
        assert m["batch/shared_tokens"] == m["batch/real_tokens"] - m["batch/computed_tokens"] > 0
        if split != "token cap 80":  # 2 rows or 200 tokens: each prompt's samples sit together
            assert packed["metrics"]["batch/computed_tokens"] - shared["metrics"]["batch/computed_tokens"] >= 2 * 21


def test_every_row_reads_exactly_its_own_start_however_the_prompts_nest(small_prefixes):
    """Random GRPO-like micro-batches (system prompts shared by some prompts, prompts by their samples, rows
    shuffled, left padding): the pieces each row's attention reads hold its own first tokens, in order."""
    from syncwise.data.prefixes import shared_units

    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        systems = [torch.randint(1, 9, (int(n),), generator=gen) for n in torch.randint(0, 5, (2,), generator=gen)]
        prompts = [torch.cat([systems[int(torch.randint(0, 2, (1,), generator=gen))],
                              torch.randint(1, 9, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)])
                   for _ in range(3)]
        rows = [(p, torch.randint(1, 9, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen))
                for p in prompts for _ in range(int(torch.randint(1, 5, (1,), generator=gen)))]
        rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        loss = torch.zeros_like(ids)
        for i, (p, r) in enumerate(rows):
            ids[i, width - len(p) - len(r):] = torch.cat([p, r])
            loss[i, width - len(r):] = 1
        mask = (ids > 0).long()
        packed, packing = pack({"input_ids": ids, "attention_mask": mask, "loss_mask": loss}, share_prefixes=True)
        flat = packed["input_ids"][0]
        reads = packing.attention_inputs().get("shared_prefix", [[] for _ in rows])
        for i, (pieces, (p, _)) in enumerate(zip(reads, rows, strict=True)):
            n = int(packing.shared[i])
            assert n <= len(p) - 1  # never the prompt's last token: its logits predict the response
            read = torch.cat([flat[a:a + k] for a, k in pieces]) if pieces else flat[:0]
            assert read.tolist() == p[:n].tolist()
        units, computed = shared_units(ids, mask.bool(), loss)
        assert sorted(r for u in units for r in u) == list(range(len(rows)))
        for unit in units:  # a unit: rows with one whole prompt
            assert len({tuple(rows[r][0].tolist()) for r in unit}) == 1
        assert int(computed.sum()) == packed["input_ids"].shape[1]
