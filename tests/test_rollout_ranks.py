"""``dist.rollout_ranks`` (issue 48), its parts on real processes: the job's world split in two roles, the
weights' way to the rollout ranks and the scored batches' way back; and the config's rules. The jobs themselves
are tested in test_train.py (equal to the colocated job with the same lag, step for step, resumed exactly;
torchrun across two nodes) and test_stop_and_errors.py (Ctrl-C, an error on a rollout rank)."""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from syncwise.config import ConfigError, load_config
from syncwise.rl.rollout.channel import RolloutChannel
from syncwise.rl.rollout.queue import ScoredBatch
from syncwise.runtime.launcher import launch_local
from syncwise.runtime.roles import join_roles


def _units() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"model.embed.weight": torch.randn(5, 3, generator=generator),
             "model.norm.weight": torch.randn(3, generator=generator).to(torch.bfloat16)},
            {"lm_head.weight": torch.randn(5, 3, generator=generator)}]


def _scored(step: int, trainer: int) -> ScoredBatch:
    ids = torch.tensor([[1, 2, 3]])
    return ScoredBatch(step, step - 1, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                        "loss_mask": torch.tensor([[0, 1, 1]])},
                       torch.zeros(1, 2), torch.tensor([float(step * 10 + trainer)]), {}, [],
                       torch.tensor([2]), torch.tensor([False]), torch.zeros(0), None, 0.0,
                       rollout_rank_s=torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))


BIG_UNITS, BIG_UNIT_NUMEL = 4, 4 * 2**20  # 16 MiB each in float32
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _big_units():
    """Units made as they are asked for (as the trainers' gather makes them), each dropped by its consumer."""
    for i in range(BIG_UNITS):
        yield {f"layers.{i}.weight": torch.full((BIG_UNIT_NUMEL,), float(i))}


def _peak_growth(transfer) -> int:
    """How far this process's resident size rose above where it stood while ``transfer()`` ran."""
    def resident(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak resident size starts again from here
    before = resident("VmRSS")
    transfer()
    return resident("VmHWM") - before


def _both_roles(out_dir: str) -> None:
    """Three ranks: two trainers, one rollout rank serving both. Trainer 0 sends version 3's weights with steps
    4 and 5 to draw; the rollout rank posts each trainer's batches; the trainers fetch them. Then a model of four
    16 MiB units, loaded unit by unit into the rollout rank's copy: each side's resident peak measured."""
    # Large blocks mapped and unmapped as they come and go (glibc would otherwise raise its mapping threshold after
    # the first free and keep freed blocks in its heap): the resident size then follows what is alive.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    info, roles = join_roles(1, "gloo", 60.0)
    channel = RolloutChannel(roles, info.device, 60.0)
    result: dict = {"info": (info.rank, info.world_size), "rollout": roles.is_rollout}
    if roles.is_rollout:
        draw = channel.next_draw(0)
        result["draw"] = (draw.version, draw.steps)
        result["units"] = [dict(unit) for unit in channel.receive_weights(0)]
        result["moved"] = (channel.last.bytes, channel.last.largest_unit_bytes)
        for step in draw.steps:
            for trainer in roles.served_by(roles.rollout_index):
                channel.post(step, trainer, _scored(step, trainer))
        copy = torch.full((BIG_UNITS, BIG_UNIT_NUMEL), -1.0)  # the rollout copy the units load into (touched)
        channel.next_draw(1)

        def load() -> None:  # as load_by_unit does (no enumerate: it would keep the last unit)
            for unit in channel.receive_weights(1):
                ((name, tensor),) = unit.items()
                copy[int(name.split(".")[1])] = tensor
                tensor = unit = None

        result["peak_growth"] = _peak_growth(load)
        result["loaded"] = copy[:, 0].tolist()
        result["after_end"] = channel.next_draw(2)
    else:
        summed = torch.ones(1)
        dist.all_reduce(summed)  # the trainers' own default group
        result["trainers"] = summed.item()
        channel.send_weights(3, [4, 5], iter(_units()))
        result["moved"] = (channel.last.bytes, channel.last.largest_unit_bytes)
        result["fetched"] = [channel.fetch(step, info.rank).rewards.item() for step in (4, 5)]
        result["peak_growth"] = _peak_growth(lambda: channel.send_weights(4, [6], _big_units()))
        channel.end()
        dist.barrier()
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{roles.job_rank}.pt")


def test_the_trainers_send_weights_and_the_rollout_ranks_send_batches_back():
    """What each side sees, and (the issue's target) the transfer's peak: one unit beyond each side's model."""
    with tempfile.TemporaryDirectory() as out_dir:
        job = launch_local(_both_roles, 3, out_dir)
        assert job.exit_code == 0, job.lines
        trainer0, trainer1, rollout = (torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(3))
    assert (trainer0["info"], trainer1["info"], rollout["info"]) == ((0, 2), (1, 2), (0, 1))
    assert trainer0["trainers"] == trainer1["trainers"] == 2  # a world of the two trainers
    assert rollout["draw"] == (3, [4, 5]) and rollout["after_end"] is None
    for sent, received in zip(_units(), rollout["units"], strict=True):
        assert sent.keys() == received.keys()
        for name, tensor in sent.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    unit_bytes = [sum(t.numel() * t.element_size() for t in unit.values()) for unit in _units()]
    assert trainer0["moved"] == rollout["moved"] == (sum(unit_bytes), max(unit_bytes))
    assert trainer0["fetched"] == [40.0, 50.0] and trainer1["fetched"] == [41.0, 51.0]
    # while the weights move each side holds one unit beyond its model, not the model's four: the receiver one
    # (measured 1.31-1.32 units), the sender one or, for a moment, two (1.05-2.06: gloo's worker thread lets go
    # of the unit it sent just after the send completes, sometimes after the next unit exists)
    unit = BIG_UNIT_NUMEL * 4
    assert rollout["loaded"] == [0.0, 1.0, 2.0, 3.0]
    assert 0.5 < rollout["peak_growth"] / unit < 1.6, rollout["peak_growth"] / unit
    assert 0.5 < trainer0["peak_growth"] / unit < 2.5, trainer0["peak_growth"] / unit


def _forged_batch(out_dir: str) -> None:
    """Two ranks: a trainer and a rollout rank. A writer without the job's secret (a plain store client, as a
    program that found the port would be) puts a batch of rewards 5.0 where the trainer fetches step 4's; the
    rollout rank then posts its real step 5. The trainer refuses the forgery, naming its key, and takes step 5."""
    import io
    import os

    info, roles = join_roles(1, "gloo", 60.0)
    channel = RolloutChannel(roles, info.device, 60.0)
    result: dict = {}
    if roles.is_rollout:
        intruder = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        forged = _scored(4, 0)
        forged.rewards = torch.tensor([5.0])
        buffer = io.BytesIO()
        torch.save(forged.state(), buffer)
        intruder.set("syncwise/attempt_0/rollout_ranks/batch/4/0", buffer.getvalue())
        channel.post(5, 0, _scored(5, 0))
    else:
        try:
            channel.fetch(4, 0)
        except Exception as exc:  # noqa: BLE001 - what the trainer meets is the result
            result["refused"] = (type(exc).__name__, str(exc))
        result["real"] = channel.fetch(5, 0).rewards.item()
    torch.save(result, Path(out_dir) / f"rank{roles.job_rank}.pt")


def test_a_batch_written_into_the_store_by_anyone_but_the_job_is_refused():
    """Issue 62 (1): a program that reached the job's store rewrote posted batches and ten steps trained on rewards
    of 5.0 without a word. What the roles post is signed with the job's secret (the launcher's, never the
    sandbox's): the forgery stops the trainer in one line naming the key; the real batch still arrives."""
    with tempfile.TemporaryDirectory() as out_dir:
        job = launch_local(_forged_batch, 2, out_dir)
        assert job.exit_code == 0, job.lines
        trainer = torch.load(Path(out_dir) / "rank0.pt", weights_only=False)
    assert trainer["refused"] == ("ForgedMessage", "the job's store held 'batch/4/0' not signed by this job: something "
                                  "outside the job wrote it (another process on this machine or network, or a value "
                                  "recorded from another run); the job stops rather than use it")
    assert trainer["real"] == 50.0


@pytest.mark.parametrize(("overrides", "message"), [
    (["dist.nproc=4", "dist.rollout_ranks=3", "rl.off_policy_lag=1"],
     "dist.rollout_ranks=3 of dist.nproc=4: at least as many ranks must train"),
    (["dist.rollout_ranks=-1"], "dist.rollout_ranks"),
    # issue 62 (10): an explicit synchronous request was taken for "unset" and ran at lag 1 without a word
    (["dist.nproc=4", "dist.rollout_ranks=2", "rl.off_policy_lag=0"],
     "dist.rollout_ranks=2 with rl.off_policy_lag=0: rollout ranks sample while the trainers train"),
    # issue 62 (11): accepted silently before
    (["rl.partial_chunk_tokens=8"], "rl.partial_chunk_tokens=8 is the round of a partial rollout: it needs "
                                    "rl.max_staleness >= 1"),
    (["rl.off_policy_lag=5", "train.steps=5"], "rl.off_policy_lag=5 with train.steps=5: every step would train on "
                                               "the initial policy's samples"),
])
def test_rollout_ranks_refuse_what_they_cannot_run(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_explicit_lag_of_0_beside_rollout_ranks_is_one_line_and_exit_2():
    from cli_harness import run_cli

    proc = run_cli(["train", "dist.nproc=4", "dist.rollout_ranks=2", "rl.off_policy_lag=0"])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "rl.off_policy_lag=0" in proc.stderr and "rl.max_staleness >= 1" in proc.stderr


def test_rollout_ranks_resolve_the_lag_and_its_loss():
    """One step off-policy unless the lag is set (the split's point is that sampling overlaps training)."""
    config = load_config(None, ["dist.nproc=4", "dist.rollout_ranks=2"])
    assert config.rl.off_policy_lag == 1 and config.rl.is_off_policy and config.rl.loss.off_policy == "decoupled"
    assert load_config(None, ["dist.nproc=4", "dist.rollout_ranks=2", "rl.off_policy_lag=3"]).rl.off_policy_lag == 3
    # partial rollouts drawn on (the fast mode): no lag, the bound instead
    drawing_on = load_config(None, ["dist.nproc=4", "dist.rollout_ranks=2", "rl.max_staleness=2"]).rl
    assert (drawing_on.off_policy_lag, drawing_on.max_staleness, drawing_on.loss.off_policy) == (0, 2, "decoupled")
