"""On a CUDA device (skipped elsewhere): NCCL, the allocator's peak every step, CPU offload of FSDP2
parameters -- whose gradient norm must travel on the device, since NCCL takes no CPU tensor -- and packed rows
through torch's variable-length kernel (on torch 2.11, which takes no ``enable_gqa``, with the key / value heads
repeated). ``syncwise bench --workload gpu`` runs them first."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from scenarios import engine_config, full_params, make_batch
from syncwise.engine import Engine
from syncwise.losses import sft_loss
from syncwise.models import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_suite(info) -> dict:
    out = {"device": str(info.device)}
    params = {}
    for offload in (False, True):
        cfg = engine_config("fsdp2", "deferred", f"engine.cpu_offload={str(offload).lower()}")
        engine = Engine(cfg, build_model(cfg.model), info)
        steps = [engine.train_batch(make_batch(seed=s), sft_loss) for s in (1, 2)]
        params[offload] = {k: v.cpu() for k, v in full_params(engine).items()}
        out[("steps", offload)] = steps
        out[("param_device", offload)] = str(next(engine.model.parameters()).device)
    out["max_param_diff"] = max((params[True][k] - params[False][k]).abs().max().item() for k in params[True])
    cfg = engine_config("fsdp2", "auto", "model.param_dtype=bfloat16")
    engine = Engine(cfg, build_model(cfg.model), info)
    out["auto"] = [engine.train_batch(make_batch(seed=s), sft_loss) for s in (3, 4, 5)]
    out["varlen"] = _packed_kernels(info)
    return out


def _packed_kernels(info) -> dict:
    """bf16 FSDP2, one batch of ragged sequences: padded, packed through the kernel chosen at start
    (varlen_attn), packed through the per-sequence loop; gradients of each."""
    from scenarios import full_grads
    from syncwise.data import attention

    batch = make_batch(seed=11, size=8, seq_len=48)
    out = {}
    for name, packing in (("padded", "false"), ("kernel", "true"), ("loop", "true")):
        cfg = engine_config("fsdp2", "deferred", "model.param_dtype=bfloat16", "model.reduce_dtype=float32",
                            f"engine.packing={packing}", "engine.max_tokens_per_micro_batch=128")
        engine = Engine(cfg, build_model(cfg.model), info)
        if name == "loop":
            attention._kernel = "loop"
        out[(name, "kernel")] = attention.current_kernel()
        engine.forward_backward_batch(batch, sft_loss)
        out[(name, "grads")] = {k: v.float().cpu() for k, v in full_grads(engine).items()}
    return out


@pytest.fixture(scope="module")
def cuda():
    return run_distributed(cuda_suite, 1, backend="nccl")[0]


def test_runs_on_the_gpu_with_nccl(cuda):
    assert cuda["device"].startswith("cuda")
    assert cuda[("param_device", False)].startswith("cuda")


def test_cpu_offload_trains_and_matches_the_gpu_run(cuda):
    assert cuda[("param_device", True)] == "cpu"
    for steps in (cuda[("steps", True)], cuda[("steps", False)]):
        assert all(torch.isfinite(torch.tensor(m["train/grad_norm"])) for m in steps)
        assert all(m["train/skipped"] == 0 for m in steps)
    assert cuda["max_param_diff"] < 1e-4


def test_peak_measured_every_step_and_auto_decides(cuda):
    steps = cuda["auto"]
    assert all(m["memory/peak_measured"] == 1 and m["memory/peak_bytes"] > 0 for m in steps)
    assert [m["sync/mode"] for m in steps] == ["per_microbatch", "deferred_unsharded", "deferred_unsharded"]


def test_packed_rows_take_one_varlen_kernel_with_the_padded_gradients(cuda):
    """torch's varlen_attn is chosen for bf16 packed rows, and its gradients equal the padded path's and the
    per-sequence loop's within bf16 resolution."""
    from numerics import assert_all_close

    runs = cuda["varlen"]
    assert runs[("kernel", "kernel")] == "varlen_attn" and runs[("loop", "kernel")] == "loop"
    assert_all_close(runs[("kernel", "grads")], runs[("padded", "grads")], 3e-2, "varlen_attn vs padded")
    assert_all_close(runs[("kernel", "grads")], runs[("loop", "grads")], 3e-2, "varlen_attn vs loop")
