"""Issue 61: the door between the trainers and the rollout ranks in two parts, each tested alone -- the mailbox
(messages, batches, snapshots and starting points on a store, signed; every key deleted by its last reader) and
the weight transport (units over a real two-process gloo group). The parts together on real roles:
test_rollout_ranks.py; the jobs: test_train.py."""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from syncwise.rl.rollout.mailbox import BatchMailbox
from syncwise.rl.rollout.queue import ScoredBatch
from syncwise.rl.rollout.weight_transport import WeightTransport
from syncwise.runtime.job_store import ForgedMessage, SignedStore
from syncwise.runtime.launcher import launch_local

SECRET = b"a job's secret"


def _scored(step: int) -> ScoredBatch:
    ids = torch.tensor([[1, 2, 3]])
    return ScoredBatch(step, step - 1, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                        "loss_mask": torch.tensor([[0, 1, 1]])},
                       torch.zeros(1, 2), torch.tensor([float(step)]), {}, [], torch.tensor([2]),
                       torch.tensor([False]), torch.zeros(0), None, 0.0)


def _keys(store: dist.Store, keys: list[str]) -> list[str]:
    return [key for key in keys if store.check([key])]


def test_the_mailbox_carries_messages_to_every_reader_and_leaves_no_key_behind():
    plain = dist.HashStore()
    writer, reader_a, reader_b = (BatchMailbox(SignedStore(plain, SECRET), readers=2) for _ in range(3))
    writer.announce(0, version=3, steps=[4, 5])
    writer.ask_snapshot(1)
    for reader in (reader_a, reader_b):
        draw = reader.next_draw(0)
        assert (draw.number, draw.version, draw.steps, draw.snapshot) == (0, 3, [4, 5], False)
        assert reader.has_message(1) and reader.next_draw(1).snapshot
    assert _keys(plain, ["msg/0", "read/0", "msg/1", "read/1"]) == []  # the second reader cleaned up
    reader_a.post(4, 1, _scored(4))
    reader_a.post_snapshot(1, 1, {"next_step": 6, "partial_rollouts": {"admitted": 12, "groups": []}})
    writer.post_start(1, {"next_step": 0})
    assert writer.fetch(4, 1).rewards.tolist() == [4.0]
    assert writer.take_snapshot(1, 1)["next_step"] == 6 and reader_a.start_of(1) == {"next_step": 0}
    assert _keys(plain, ["batch/4/1", "snap/1/1", "start/1"]) == []  # one reader each: deleted once read
    assert not reader_a.has_message(2)
    writer.announce_end(2)
    assert reader_a.next_draw(2) is None


def test_the_mailbox_refuses_a_batch_the_job_did_not_sign():
    plain = dist.HashStore()
    BatchMailbox(SignedStore(plain, b"someone else"), readers=1).post(4, 0, _scored(4))
    with pytest.raises(ForgedMessage, match="'batch/4/0' not signed by this job"):
        BatchMailbox(SignedStore(plain, SECRET), readers=1).fetch(4, 0)


def test_a_message_recorded_from_another_run_does_not_verify_under_the_same_secret():
    """Issue 67 (11): the secret left in the environment from job to job; a batch recorded from run A and set first
    in run B's store is refused, not trained on."""
    plain = dist.HashStore()
    BatchMailbox(SignedStore(plain, SECRET, run="run-a"), readers=1).post(3, 0, _scored(3))
    with pytest.raises(ForgedMessage, match="'batch/3/0' not signed by this job"):
        BatchMailbox(SignedStore(plain, SECRET, run="run-b"), readers=1).fetch(3, 0)
    BatchMailbox(SignedStore(plain, SECRET, run="run-b"), readers=1).post(3, 0, _scored(3))
    assert BatchMailbox(SignedStore(plain, SECRET, run="run-b"), readers=1).fetch(3, 0).rewards.tolist() == [3.0]


def _units(count: int):
    for i in range(count):  # made as they are asked for, as the trainers' gather makes them
        yield {f"layers.{i}.weight": torch.full((3, 2), float(i)), f"layers.{i}.norm": torch.arange(3.0).to(
            torch.bfloat16)}


def _transport(out_dir: str) -> None:
    """Three ranks over one gloo group: rank 0 sends two transfers of units, ranks 1 and 2 receive them."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    transport = WeightTransport(SignedStore(store, SECRET), dist.group.WORLD, torch.device("cpu"), receivers=2)
    result: dict = {}
    if rank == 0:
        for number, count in ((0, 3), (1, 1)):
            moved = transport.send(number, _units(count))
            result[number] = (moved.bytes, moved.largest_unit_bytes)
        # a trainer without the group takes part in the gather only: it consumes the units, sends nothing
        consumed = []
        WeightTransport(SignedStore(store, SECRET), None, torch.device("cpu"), 2).send(
            2, (consumed.append(u) or u for u in _units(2)))
        result["consumed"] = len(consumed)
    else:
        for number in (0, 1):
            result[number] = [{k: v.clone() for k, v in unit.items()} for unit in transport.receive(number)]
            result[f"{number}/moved"] = (transport.last.bytes, transport.last.largest_unit_bytes)
    dist.barrier()
    result["keys_left"] = [key for key in ("unit/0/0", "unit/0/3", "units_read/0", "unit/1/1", "unit/2/0")
                           if store.check([key])]
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_the_weights_go_unit_by_unit_to_every_receiver_and_their_keys_are_deleted():
    with tempfile.TemporaryDirectory() as out_dir:
        job = launch_local(_transport, 3, out_dir)
        assert job.exit_code == 0, job.lines
        sender, *receivers = (torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(3))
    unit_bytes = 3 * 2 * 4 + 3 * 2
    assert sender[0] == (3 * unit_bytes, unit_bytes) and sender[1] == (unit_bytes, unit_bytes)
    assert sender["consumed"] == 2
    for received in receivers:
        assert received["0/moved"] == sender[0] and received["1/moved"] == sender[1]
        for number, count in ((0, 3), (1, 1)):
            want = list(_units(count))
            assert [list(u) for u in received[number]] == [list(u) for u in want]
            for got, sent in zip(received[number], want, strict=True):
                assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in sent.items())
    assert sender["keys_left"] == receivers[0]["keys_left"] == []  # the last receiver cleaned up
