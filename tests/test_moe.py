"""Issue 79: a mixture of experts (a tiny Qwen3-MoE as transformers 5 builds it: fused experts, a top-k router).
Router replay: the training forward routes each token through the experts given for it, with the weights from
the live router's probabilities -- its logits equal the live forward's where the routes are the router's own, and
the router's gradient equals a reference that replays by hand where they are not; the compact sampler records
the experts its forwards chose; a GRPO job with a bfloat16 sampler beside fp32 training trains through them
(``moe/route_agreement`` below 1) and its sampler-trainer log-prob gap drops against the same job without."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from cli_harness import run_cli
from job_output import failed
from numerics import assert_close
from syncwise.models.moe import LOAD, ROUTES, RouteRecorder, route_replay


def _moe(seed: int = 0, experts_implementation: str = "eager"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, experts_implementation=experts_implementation,
                            norm_topk_prob=True)  # as Qwen3-30B-A3B's
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def _routes_of(model, ids: torch.Tensor) -> torch.Tensor:
    """The experts each token goes through, as the model's own routers choose: [tokens, layers, k]."""
    recorder = RouteRecorder(model)
    try:
        with torch.no_grad():
            model(input_ids=ids)
        return recorder.take()
    finally:
        recorder.close()


def _router_grads(model) -> list[torch.Tensor]:
    return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]


@contextlib.contextmanager
def _by_hand(model, routes: torch.Tensor):
    """Within it, each router's forward written out with the given experts ([tokens, layers, k]): its
    probabilities' softmax over the live logits, renormalised over the chosen k where norm_topk_prob says."""
    gates = [layer.mlp.gate for layer in model.model.layers]
    originals = [gate.forward for gate in gates]

    def by_hand(layer: int):
        def forward(hidden):
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), gates[layer].weight)
            chosen = routes[:, layer].long()
            weights = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
            if model.config.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return forward

    for layer, gate in enumerate(gates):
        gate.forward = by_hand(layer)
    try:
        yield
    finally:
        for gate, forward in zip(gates, originals, strict=True):
            gate.forward = forward


def _replayed_by_hand(model, ids: torch.Tensor, routes: torch.Tensor) -> list[torch.Tensor]:
    """The routers' gradients under :func:`_by_hand`'s routes."""
    model.zero_grad()
    with _by_hand(model, routes):
        model(input_ids=ids).logits.float().square().mean().backward()
    return _router_grads(model)


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm"])
def test_replayed_routes_give_the_live_forward_where_they_are_its_own_and_the_router_still_learns(kernel):
    model = _moe(experts_implementation=kernel)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    own = _routes_of(model, ids)
    assert own.shape == (22, 2, 2) and own.dtype == torch.int16

    model.zero_grad()
    live = model(input_ids=ids).logits
    live.float().square().mean().backward()
    live_grads = _router_grads(model)
    model.zero_grad()
    replay = route_replay(model, own.view(2, 11, 2, 2))
    replayed = model(input_ids=ids).logits
    assert (replay.matches, replay.choices) == (22 * 2 * 2, 22 * 2 * 2)  # every choice the live router's own
    replayed.float().square().mean().backward()
    assert_close(replayed.detach(), live.detach(), 1e-6, "replaying the router's own routes")
    for got, expected in zip(_router_grads(model), live_grads, strict=True):
        assert_close(got, expected, 1e-5, "the router's gradient under its own routes")

    # other experts for every token (each token's choice shifted by one expert): the weights still come from
    # the live router's probabilities, so its gradient is a replay's by hand -- and not zero
    other = (own.long() + 1) % 8
    replay = route_replay(model, other)
    model.zero_grad()
    model(input_ids=ids).logits.float().square().mean().backward()
    assert replay.choices == 88 and replay.matches < replay.choices
    got = _router_grads(model)
    route_replay(model, None)
    for grad, expected in zip(got, _replayed_by_hand(model, ids, other), strict=True):
        assert grad.abs().sum() > 0
        assert_close(grad, expected, 1e-5, "the router's gradient under replayed routes")
    assert _routes_of(model, ids).equal(own)  # cleared: the routers choose again


def test_the_compact_sampler_records_the_experts_each_token_went_through():
    """Each sequence's routes: its prompt's from the prefill, each drawn token's from the forward that fed it
    (compaction and left padding included), the last token's -1 (never fed) -- the routes a whole forward of the
    same model over prompt and response chooses."""
    from syncwise.rl.rollout.compact import sample

    model = _moe().eval()
    prompts = [torch.tensor([5, 9, 17, 33, 2]), torch.tensor([7, 8])]
    with torch.random.fork_rng():
        torch.manual_seed(3)
        samples = sample(model, prompts, 3, 9, 1.0, [0, 1, 2], 127, record_routes=True)
    assert len(samples.routes) == 6
    agree = total = 0
    for k, (tokens, routes) in enumerate(zip(samples.tokens, samples.routes, strict=True)):
        prompt = prompts[k // 3]
        assert routes.shape == (len(prompt) + len(tokens), 2, 2)
        assert bool((routes[-1] == -1).all()) and bool((routes[:-1] >= 0).all())
        whole = _routes_of(model, torch.cat([prompt, tokens])[None])[:-1]
        agree += int((whole.sort(-1).values == routes[:-1].sort(-1).values).sum())
        total += whole.numel()
    assert agree / total > 0.99, agree / total  # incremental and whole forwards: fp32 near-ties may part


def test_generate_records_the_experts_each_token_went_through():
    """``rl.rollout_engine=generate`` under replay: each sequence's routes as the compact sampler files them -- its
    prompt's from the prefill of the left-padded rows, each drawn token's from the decode step that fed it, the last
    -1 -- the routes a whole forward of the same model over prompt and response chooses."""
    from types import SimpleNamespace

    from syncwise.config import RLConfig
    from syncwise.rl.rollout.base import StopStrings
    from syncwise.rl.rollout.compact import Truncation
    from syncwise.rl.rollout.local import GenerateRollout

    rollout = GenerateRollout.__new__(GenerateRollout)  # its copy is the test's model (no refresh from a trainer)
    rollout.cfg, rollout.device, rollout.record_routes = RLConfig(), torch.device("cpu"), True
    rollout.tokenizer, rollout.end_ids = SimpleNamespace(pad_token_id=127), [0, 1, 2]
    rollout.cut, rollout.stop = Truncation(0, 1.0, 0.0), StopStrings([], None)
    rollout.model = _moe().eval()
    prompts = [[5, 9, 17, 33, 2], [7, 8]]
    samples = rollout.sample(prompts, 3, 9, seed=3)
    assert len(samples.routes) == 6
    agree = total = 0
    for k, (tokens, routes) in enumerate(zip(samples.tokens, samples.routes, strict=True)):
        prompt = torch.tensor(prompts[k // 3])
        assert routes.shape == (len(prompt) + len(tokens), 2, 2)
        assert bool((routes[-1] == -1).all()) and bool((routes[:-1] >= 0).all())
        whole = _routes_of(rollout.model, torch.cat([prompt, tokens])[None])[:-1]
        agree += int((whole.sort(-1).values == routes[:-1].sort(-1).values).sum())
        total += whole.numel()
    assert agree / total > 0.99, agree / total  # incremental and whole forwards: fp32 near-ties may part


def test_the_engine_trains_through_replayed_routes_in_every_mode_as_a_replay_by_hand_does(tmp_path):
    """2 gloo ranks, FSDP2: per_microbatch, deferred packed and padded, deferred_unsharded with activation
    checkpointing (the recompute routes as the forward did) -- each parameter's gradient, the routers' and the
    experts' included, equals one process's over the whole batch with every router replaced by a replay written
    out by hand, the routers' load-balancing loss (transformers', per micro-batch) added alike; padding tokens (-1)
    route live and count in no agreement."""
    from transformers import AutoModelForCausalLM

    from dist_harness import run_distributed
    from scenarios_moe import AUX_COEF, REPLAY_CASES, replay_suite
    from user_models import save_model_dir

    path = save_model_dir(tmp_path, "qwen3_moe", hidden=32, heads=4, inter=64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    lengths = [9, 14, 5, 12, 7, 11]
    width = max(lengths)
    ids = torch.randint(3, model.config.vocab_size, (6, width), generator=generator)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    own = [_routes_of(model, ids[i, :n][None]) for i, n in enumerate(lengths)]
    other = [(r.long() + 1 + (i % 3)) % 8 for i, r in enumerate(own)]  # not the routers' choice: another expert
    routes = torch.full((6, width, 2, 2), -1, dtype=torch.int16)
    for i, n in enumerate(lengths):
        routes[i, :n] = other[i]
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, ROUTES: routes}

    # the reference: one process, each sequence alone (a micro-batch of its own), the token-mean over the whole
    # batch's targets, and transformers' load-balancing loss of each sequence weighted by its share of them
    model.zero_grad()
    targets = sum(n - 1 for n in lengths)
    aux_total = 0.0
    for i, n in enumerate(lengths):
        with _by_hand(model, other[i]):
            out = model(input_ids=ids[i, :n][None], output_router_logits=True)
        logits = out.logits[0, :-1].float()
        aux = out.aux_loss * (n - 1) / targets
        loss = -torch.log_softmax(logits, -1).gather(1, ids[i, 1:n, None]).sum() / targets + AUX_COEF * aux
        loss.backward()
        aux_total += float(aux.detach())
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}

    outs = run_distributed(replay_suite, 2, str(path), batch)
    for name in REPLAY_CASES:
        got = outs[0][name]["grads"]
        for param, grad in expected.items():
            assert_close(got[param], grad, 1e-4, f"{name}: {param}")
        assert all(out[name]["grads"].keys() == got.keys() for out in outs)
        choices = sum(out[name]["choices"] for out in outs)
        assert choices == 2 * 2 * sum(lengths), (name, choices)  # real tokens only, the recompute not again
        assert sum(out[name]["matches"] for out in outs) < choices
        assert sum(out[name]["aux"] for out in outs) == pytest.approx(aux_total, rel=1e-5)
        # each layer's expert load: the replayed experts of the real tokens
        for layer in range(2):
            expected_load = torch.bincount(torch.cat([r[:, layer].reshape(-1) for r in other]), minlength=8)
            load = [sum(out[name]["load"][f"{LOAD}{layer}/{e}"] for out in outs) for e in range(8)]
            assert load == expected_load.tolist(), (name, layer, load)


def _job(folder, replay: str, *extra: str, out: str | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "HF_HUB_OFFLINE": "1"}
    environ.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "syncwise", "train", f"model.path={folder / 'qwen3_moe'}",
                           "train.steps=1", "train.progress=false", f"train.out_dir={folder / (out or replay)}",
                           "rl.max_new_tokens=12", "rl.prompts_per_rank=2", "rl.samples_per_prompt=4",
                           "rl.rollout_dtype=bfloat16", f"rl.router_replay={replay}", "train.export=false", *extra],
                          cwd=folder, capture_output=True, text=True, env=environ, timeout=600)


def test_rollout_ranks_send_the_routes_and_a_resumed_lagged_job_replays_what_its_checkpoint_kept(tmp_path):
    """dist.rollout_ranks=1 of 2 (a lag of one step): the rollout rank's sampler records the routes, they travel
    to the trainer with the batch and into its checkpoint's queued batch -- the job resumed at step 2 trains step 3
    as the one that ran through did (the same routes' agreement, log-prob gap and loss)."""
    from user_models import save_model_dir

    save_model_dir(tmp_path, "qwen3_moe")
    keys = ("train.steps=3", "train.checkpoint_every=1", "dist.nproc=2", "dist.rollout_ranks=1")
    through = _job(tmp_path, "true", *keys, out="through")
    assert through.returncode == 0, failed(through.stderr, 3000)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "through", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_000003")
    rows = (resumed_dir / "metrics.jsonl").read_text().splitlines()
    (resumed_dir / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n")
    resumed = _job(tmp_path, "true", *keys, f"train.resume={resumed_dir / 'checkpoints' / 'step_000002'}",
                   out="resumed")
    assert resumed.returncode == 0, failed(resumed.stderr, 3000)
    steps = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("through", "resumed")}
    assert all(0.5 < step["moe/route_agreement"] < 1.0 for step in steps["through"])
    for key in ("moe/route_agreement", "rollout/log_prob_diff", "loss"):
        assert steps["resumed"][2][key] == pytest.approx(steps["through"][2][key], rel=1e-6, abs=1e-9), key


def test_a_ppo_job_trains_through_its_samplers_routes_and_its_log_prob_gap_drops(tmp_path):
    """A Qwen3-MoE saved with save_pretrained (its experts' weights scaled up, so that a token routed elsewhere
    changes its log-prob), a bfloat16 sampler beside fp32 training on 2 ranks, PPO: with replay the update routes
    by the sampler's choices (moe/route_agreement: the share the live routers make alike, below 1 here) and the gap
    between the sampler's and the trainer's log-probs is smaller than the same job's without; the critic, a
    mixture of experts too, routes by its own routers (its experts' load logged, no replay)."""
    from transformers import AutoModelForCausalLM

    from user_models import save_model_dir

    path = save_model_dir(tmp_path, "qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.mul_(8.0)
            layer.mlp.gate.weight.mul_(4.0)
    model.save_pretrained(path)
    runs = {}
    for replay in ("true", "false"):
        job = _job(tmp_path, replay, "rl.algorithm=ppo")
        assert job.returncode == 0, failed(job.stderr, 3000)
        runs[replay] = [json.loads(line) for line in (tmp_path / replay / "metrics.jsonl").read_text().splitlines()]
        said = "a mixture of experts, trained through the experts its sampler chose (rl.router_replay)"
        assert (said in job.stdout) == (replay == "true"), job.stdout
    for step in runs["true"]:
        assert 0.5 < step["moe/route_agreement"] < 1.0, step["moe/route_agreement"]
    assert all("moe/route_agreement" not in step for step in runs["false"])
    for step in runs["true"] + runs["false"]:  # the busiest expert's load over the mean, in the worst layer
        assert 1.0 <= step["moe/load_max_over_mean"] <= 8.0 and not any(k.startswith(LOAD) for k in step)
        assert 1.0 <= step["critic/moe/load_max_over_mean"] <= 8.0 and "critic/moe/route_agreement" not in step
    # a token routed elsewhere by the sampler than by the trainer is the largest gap: measured 0.004 with replay,
    # 0.04-0.06 without; the mean over tokens 0.001 against 0.0013-0.0018
    gap = {replay: [sum(step[f"rollout/log_prob_diff{kind}"] for step in steps) for kind in ("_max", "")]
           for replay, steps in runs.items()}
    assert gap["true"][0] < 0.5 * gap["false"][0] and gap["true"][1] < gap["false"][1], gap


def test_router_replay_where_it_cannot_be_is_one_line(tmp_path):
    from user_models import save_model_dir

    path = save_model_dir(tmp_path, "qwen3_moe")
    job = run_cli(["train", f"model.path={path}", "rl.router_replay=true", "rl.rollout_engine=vllm",
                   f"train.out_dir={tmp_path / 'run'}"])
    assert job.returncode == 2 and ("rl.router_replay=true: rl.rollout_engine=vllm does not say which experts "
                                    "it chose") in job.stderr, failed(job.stderr)
    assert len(job.stderr.strip().splitlines()) == 1
    assert ROUTES == "routed_experts"


def test_an_sft_job_on_two_ranks_exports_the_experts_bit_for_bit(tmp_path):
    """A tiny Qwen3-MoE saved with save_pretrained through `syncwise sft` on 2 gloo ranks (loaded on the meta device
    shard by shard, FSDP2 over its fused experts, the routers' load-balancing loss at its config's coefficient): with
    the learning rate at 0 the export's logits are the original's bit for bit, and the job logs the experts' load and
    the balancing loss."""
    from transformers import AutoModelForCausalLM

    from syncwise.sft.tasks import write_example_data
    from user_models import save_model_dir

    path = save_model_dir(tmp_path, "qwen3_moe")
    data = write_example_data(tmp_path / "data", train_rows=32, eval_rows=4, prompt_rows=4)
    environ = {**os.environ, "HF_HUB_OFFLINE": "1"}
    environ.pop("PYTHONPATH", None)
    job = subprocess.run([sys.executable, "-m", "syncwise", "sft", f"model.path={path}",
                          f"sft.dataset={data / 'train.jsonl'}", "sft.steps=2", "sft.batch_size=8", "optim.lr=0",
                          "optim.warmup_steps=0", "sft.progress=false", f"sft.out_dir={tmp_path / 'run'}"],
                         cwd=tmp_path, capture_output=True, text=True, env=environ, timeout=600)
    assert job.returncode == 0, failed(job.stdout + job.stderr)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(step["moe/aux_loss"] > 0 and 1.0 <= step["moe/load_max_over_mean"] <= 8.0 for step in steps
               if "loss" in step)
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export", dtype=torch.float32).eval()
    ids = torch.randint(0, want.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, want(input_ids=ids).logits)


def test_a_partial_rollout_keeps_each_tokens_routes_from_the_forward_that_fed_it():
    """rl.max_staleness: a response drawn over rounds, each round prefilling prompt + tokens so far under the newest
    weights. Its routes keep what each earlier token was fed with; the last token before a round (never fed then:
    -1) takes the round's prefill's, the round's tokens their decode steps'; a stop string cut takes them back."""
    from syncwise.rl.rollout.base import Samples, Trajectory

    def call(tokens: list[int], routes: torch.Tensor) -> Samples:
        return Samples([torch.tensor(tokens)], [torch.zeros(len(tokens))], 1, [False],
                       [torch.zeros(len(tokens))], [routes])

    def routes(values: list[int]) -> torch.Tensor:  # one layer, k = 1
        return torch.tensor(values, dtype=torch.int16)[:, None, None]

    sample = Trajectory(prompt=[11, 12, 13])
    sample.take(call([21, 22, 23], routes([1, 1, 1, 2, 2, -1])), 0, 10, version=0)
    assert sample.routes.flatten().tolist() == [1, 1, 1, 2, 2, -1]
    # round 2 under new weights: its prefill re-routes prompt + the 3 tokens (7s), then 2 drawn tokens
    sample.take(call([24, 25], routes([7, 7, 7, 7, 7, 7, 3, -1])), 0, 10, version=1)
    assert sample.routes.flatten().tolist() == [1, 1, 1, 2, 2, 7, 3, -1]
    assert sample.versions == [0, 0, 0, 1, 1]
    sample.cut(4)
    assert sample.routes.flatten().tolist() == [1, 1, 1, 2, 2, 7, 3]


def test_lora_on_the_fused_experts_is_one_line_before_any_rank(tmp_path):
    """LoRA adapts the attention's linear layers of a mixture of experts; naming the fused experts module is refused
    in one line naming it (peft's own error would be its module's whole repr)."""
    from user_models import save_model_dir

    path = save_model_dir(tmp_path, "qwen3_moe")
    job = run_cli(["sft", f"model.path={path}", "model.lora.rank=4", "model.lora.target_modules=q_proj,experts",
                   f"sft.out_dir={tmp_path / 'run'}"])
    assert job.returncode == 2, failed(job.stderr)
    assert job.stderr.strip() == ("syncwise: error: model.lora.target_modules='q_proj,experts': Qwen3MoeExperts holds "
                                  "every expert's weights in one module, which LoRA cannot adapt; LoRA adapts the "
                                  "attention's linear layers (all-linear) and leaves the experts and routers frozen")


def test_a_mixtral_replays_as_qwen3_moe_does():
    """Mixtral's router (softmax over the experts, top k) records and replays alike: its own routes give the live
    forward's logits exactly, other routes reach every router with a gradient."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).float()
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    own = _routes_of(model, ids)
    with torch.no_grad():
        live = model(input_ids=ids).logits
    replay = route_replay(model, own.view(2, 11, 2, 2))
    with torch.no_grad():
        replayed = model(input_ids=ids).logits
    assert (replay.matches, replay.choices) == (88, 88)
    assert_close(replayed, live, 1e-6, "Mixtral replaying its own routes")
    replay = route_replay(model, (own.long() + 1) % 8)
    model(input_ids=ids).logits.float().square().mean().backward()
    assert replay.matches < replay.choices == 88
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.model.layers)
    route_replay(model, None)


def test_fused_experts_fewer_than_the_ranks_shard_on_their_next_dimension():
    """FSDP2 shards a parameter on dim 0; a MoE with fewer experts than ranks would leave a rank holding padding, so
    its fused experts shard on the next dimension: on 2 ranks one expert's (1, 32, 32) gate_up_proj is (1, 16, 32)
    a rank, and every gradient equals one process's over both ranks' rows."""
    from dist_harness import run_distributed
    from scenarios_moe import few_experts_model, few_experts_suite
    from syncwise.losses import Normalizer, make_sft_loss, target_mask

    gen = torch.Generator().manual_seed(4)
    batches = [{"input_ids": torch.randint(1, 128, (3, 10), generator=gen)} for _ in range(2)]
    ranks = run_distributed(few_experts_suite, 2, batches)
    assert all(r["sharded_dims"] == [1] and r["local"] == (1, 16, 32) for r in ranks)
    model = few_experts_model()
    batch = {"input_ids": torch.cat([b["input_ids"] for b in batches])}
    mask = target_mask(batch)
    norm = Normalizer(tokens=float(mask.sum()), sequences=float((mask.sum(1) > 0).sum()), dp_size=1)
    make_sft_loss("token-mean")(model(input_ids=batch["input_ids"]), batch, norm).loss.backward()
    for name, param in model.named_parameters():
        assert_close(ranks[0]["grads"][name], param.grad, what=name)
