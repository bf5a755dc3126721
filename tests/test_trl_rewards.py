"""A TRL user's reward functions as written (issue 68): TRL's signature -- everything by keyword: ``prompts``,
``completions`` (strings, or assistant messages for conversational prompts), ``completion_ids``,
``trainer_state`` and every dataset column by name -- a list of them with weights, ``None`` for "not applicable";
the project's own signatures beside them. Which one a function uses is read from its signature before any rank
starts, and so are the columns it needs; real jobs on 2 gloo ranks with string and conversational prompts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from job_output import failed
from syncwise.metrics import read_jsonl
from syncwise.rl.env.scoring import RewardFunction, RewardState, reward_functions, score
from syncwise.sft.tasks import write_example_data

# As TRL's docs write them: keyword arguments, **kwargs for the rest, a dataset column by its name
TRL_REWARDS = '''
import json
import os


def correct(completions, answer, log_extra=None, log_metric=None, **kwargs):
    """1 where the completion holds the row's answer (TRL: a column arrives by its name, one per completion); the
    answers a column of the completions table and the batch's accuracy a metric, as TRL's docs log them."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    scores = [1.0 if str(a) in t else 0.0 for t, a in zip(texts, answer)]
    if log_extra:
        log_extra("golden_answer", list(answer))
    if log_metric:
        log_metric("accuracy", sum(scores) / len(scores))
    return scores


def short_even(prompts, completions, completion_ids, trainer_state, **kwargs):
    """Not applicable (None) to every second completion; the others' length, negated."""
    with open(os.environ["TRL_LOG"], "a") as log:
        log.write(json.dumps({"prompt": type(prompts[0]).__name__, "completion": type(completions[0]).__name__,
                              "first": completions[0] if isinstance(completions[0], list) else None,
                              "ids": all(isinstance(i, int) for i in completion_ids[0]),
                              "step": trainer_state.global_step, "max_steps": trainer_state.max_steps,
                              "columns": sorted(kwargs)}) + "\\n")
    return [None if i % 2 else -len(ids) / 100 for i, ids in enumerate(completion_ids)]
'''

QUICK = ["train.progress=false", "rl.prompts_per_rank=2", "rl.samples_per_prompt=4", "train.export=false",
         "train.checkpoint_every=0", "optim.warmup_steps=0", "rl.max_new_tokens=8", "train.steps=2"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("trl_chat"), train_rows=8, eval_rows=4, prompt_rows=16)


def _train(cwd, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TRL_LOG": str(cwd / "trl_log.jsonl")})
    return subprocess.run([sys.executable, "-m", "syncwise", "train", *QUICK, *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("kind", ["conversational", "string"])
def test_trl_reward_functions_train_as_written(chat, tmp_path, kind):
    """Conversational prompts from a datasets save_to_disk folder (issue 68, 6), string prompts from JSONL."""
    import datasets

    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    rows = [json.loads(line) for line in (chat / "prompts.jsonl").read_text().splitlines()]
    if kind == "string":
        rows = [{**row, "prompt": row["prompt"][-1]["content"]} for row in rows]
        (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        dataset = "prompts.jsonl"
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "prompts_on_disk"))
        dataset = "prompts_on_disk"
    held_out = ["rl.eval_dataset=held_out.jsonl", "train.eval_every=1"] if kind == "conversational" else []
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:5]))
    proc = _train(tmp_path, f"model.path={chat / 'model'}", f"rl.dataset={dataset}",
                  "rl.reward_fn=[trl_rewards.py:correct, trl_rewards.py:short_even]", "rl.reward_weights=[1, 0.5]",
                  f"train.out_dir={tmp_path / 'out'}", *held_out)
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    assert ("syncwise train: beside the defaults: " in proc.stdout
            and "optim.lr=1e-06 (the defaults for a pretrained model)" in proc.stdout)
    # issue 69 (3): with the bar off (train.progress=false), a line a step (train.log_every=1)
    assert [line.split(" reward ")[0] for line in proc.stdout.splitlines() if line.startswith("step ")] == \
        ["step 1/2", "step 2/2"]
    if held_out:
        _assert_evaluated(tmp_path, proc)
    for row in read_jsonl(tmp_path / "out" / "metrics.jsonl"):
        if "reward/mean" not in row:
            continue  # an evaluation's row
        assert {"reward/correct", "reward/short_even"} <= set(row)
        assert row["reward/short_even"] < 0  # the mean over the samples it scored: the Nones left out
        # half the samples have short_even's None (nothing added): its part of the mean total is half its mean
        assert row["reward/mean"] == pytest.approx(row["reward/correct"] + 0.5 * row["reward/short_even"] / 2,
                                                   abs=1e-6)
        assert "reward/all_none_fraction" not in row  # correct scored every sample
        # TRL's log_metric: each rank's batch accuracy, averaged over the calls (equal batches: the mean)
        assert row["accuracy"] == pytest.approx(row["reward/correct"], abs=1e-9)
    import pandas as pd  # TRL's log_extra: a column of the completions table, beside each function's reward

    frame = pd.read_parquet(tmp_path / "out" / "completions" / "completions_00002.parquet")
    answers = {str(row["answer"]) for row in rows}
    assert len(frame) == 16 and set(frame["golden_answer"].astype(str)) <= answers
    assert frame["reward/short_even"].isna().sum() == 8 and frame["reward/correct"].notna().all()
    calls = [json.loads(line) for line in (tmp_path / "trl_log.jsonl").read_text().splitlines()]
    # 2 steps x 2 ranks, one call per batch; each of the 3 evaluations in rl.prompts_per_rank=2 chunks of a rank's
    # held-out prompts: 2 calls for rank 0's 3, 1 for rank 1's 2
    assert len(calls) == 4 + (3 * 3 if held_out else 0)
    want_prompt, want_completion = ("list", "list") if kind == "conversational" else ("str", "str")
    for call in calls:
        assert (call["prompt"], call["completion"], call["ids"]) == (want_prompt, want_completion, True)
        assert call["columns"] == ["answer", "log_extra", "log_metric"]  # TRL's reward_kwargs
        assert call["max_steps"] == 2 and call["step"] in (0, 1, 2)
        if kind == "conversational":
            assert [m["role"] for m in call["first"]] == ["assistant"]


def test_which_signature_a_function_uses_is_read_from_it():
    def trl(completions, **kwargs):
        return [0.0] * len(completions)

    def trl_named(prompts, completions, answer):  # no **kwargs: it gets what it names
        return [float(a == "1") for a in answer]

    def own(prompt, response, row):
        return 1.0

    def own_batched(prompts, responses, rows):
        return [2.0] * len(prompts)

    functions = [RewardFunction(f.__name__, "rl.reward_fn", f, batched=f is own_batched)
                 for f in (trl, trl_named, own, own_batched)]
    assert [f.trl for f in functions] == [True, True, False, False]
    totals, parts = score(functions, ["q", "q"], ["a", "b"], [{"prompt": "q", "answer": "1"},
                                                               {"prompt": "q", "answer": "2"}])
    assert parts == {"trl": [0.0, 0.0], "trl_named": [1.0, 0.0], "own": [1.0, 1.0], "own_batched": [2.0, 2.0]}
    assert totals == [4.0, 3.0]


def test_none_is_no_reward_from_that_function_and_all_none_adds_nothing():
    def half(completions, **kwargs):
        return [None, 1.0, None]

    def never(completions, **kwargs):
        return [None, None, 2.0]

    totals, parts = score([RewardFunction("half", "rl.reward_fn", half, 2.0),
                           RewardFunction("never", "rl.reward_fn", never)], ["q"] * 3, ["a", "b", "c"],
                          [{"prompt": "q"}] * 3, state=RewardState(3, 10))
    assert totals == [0.0, 2.0, 2.0] and math.isnan(parts["half"][0]) and math.isnan(parts["never"][1])


@pytest.mark.parametrize(("source", "said"), [
    ("def f(text):\n    return 1.0\n", "rl.reward_fn: f(text) fits no reward signature: TRL's (completions, **kwargs)"),
    ("def f(completions, level, **kwargs):\n    return [1.0]\n",
     "rl.reward_fn: f reads the column(s) level, which prompts.jsonl does not have (its columns: answer, prompt)"),
    ("def f(completions, **kwargs):\n    return ['high']\n", None),
])
def test_a_reward_function_that_cannot_run_is_one_line_before_any_rank(chat, tmp_path, monkeypatch, source, said):
    from cli_harness import run_cli

    (tmp_path / "bad.py").write_text(source)
    rows = [json.loads(line) for line in (chat / "prompts.jsonl").read_text().splitlines()]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    if said is None:  # what it returns is seen only once it runs: one line naming it, from the rank
        with pytest.raises(ValueError, match=r"rl.reward_fn: f: returned 'high', not a number \(None: no reward"):
            score(reward_functions(["bad.py:f"], []), ["q"], ["a"], [{"prompt": "q"}])
        return
    proc = run_cli(["train", f"model.path={chat / 'model'}", "rl.dataset=prompts.jsonl", "rl.reward_fn=bad.py:f"],
                   cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"syncwise: error: {said}"] or \
        (proc.returncode == 2 and proc.stderr.strip().startswith(f"syncwise: error: {said}")), proc.stderr


def test_the_built_in_rewards_need_the_answer_column_before_any_rank(chat, tmp_path):
    from cli_harness import run_cli

    rows = [json.loads(line) for line in (chat / "prompts.jsonl").read_text().splitlines()]
    (tmp_path / "no_answer.jsonl").write_text("".join(json.dumps({"prompt": row["prompt"]}) + "\n" for row in rows))
    proc = run_cli(["train", f"model.path={chat / 'model'}", f"rl.dataset={tmp_path / 'no_answer.jsonl'}",
                    "rl.reward_fn=syncwise.rewards:final_number"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"syncwise: error: rl.reward_fn: final_number reads the column(s) answer, which {tmp_path / 'no_answer.jsonl'} "
        "does not have (its columns: prompt)"]


def test_trl_and_verl_keys_name_syncwise_s_and_the_docs_page_is_the_table():
    """Issue 68 (5): 'optim.learning_rate', 'sft.lr' were 'unknown key' with no suggestion."""
    from pathlib import Path

    from syncwise.config import ConfigError, load_config
    from syncwise.config.peers import TRL_KEYS, VERL_KEYS, peer_table

    said = {"optim.learning_rate=1e-6": "unknown key 'optim.learning_rate': TRL's learning_rate is optim.lr here",
            "sft.lr=1e-5": "unknown key 'sft.lr': TRL's lr is optim.lr here",
            "rl.num_generations=8": "unknown key 'rl.num_generations': TRL's num_generations is rl.samples_per_prompt",
            "actor_rollout_ref.rollout.n=8": "unknown key 'actor_rollout_ref.rollout.n': verl's "
                                             "actor_rollout_ref.rollout.n is rl.samples_per_prompt here",
            "trainer.save_freq=10": "unknown key 'trainer.save_freq': verl's trainer.save_freq is "
                                    "train.checkpoint_every here"}
    for override, start in said.items():
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert str(info.value).startswith(start), str(info.value)
    page = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-trl.md").read_text()
    assert peer_table(TRL_KEYS, "TRL (GRPOConfig / SFTConfig)") in page and peer_table(VERL_KEYS, "verl") in page


def test_the_built_in_task_s_recipe_stays_with_the_built_in_task(tmp_path):
    """Issue 68 (4): `syncwise train model.path=...` layered the demo's recipe (lr 3e-3, warm-up 5, 8 prompts a
    rank, 200 steps) under the user's overrides. Now the recipe is the built-in task's alone; a job on the user's
    model starts from the defaults with TRL's GRPO learning rate, and says which keys differ and where from."""
    from syncwise.config import load_job_config

    demo, said = load_job_config("train", None, [])
    assert (demo.optim.lr, demo.rl.prompts_per_rank, demo.train.steps) == (3e-3, 8, 200)
    assert said == ["model.lora.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head, "
                    "model.preset=llama-grpo, optim.lr=0.003, optim.warmup_steps=5, rl.prompts_per_rank=8, "
                    "train.steps=200 (the built-in task's recipe, grpo.yaml)"]
    for given in (["model.path=/models/mine"], ["model.path=/models/mine", "rl.dataset=prompts.jsonl",
                                                 "rl.reward_fn=my:f"]):
        mine, said = load_job_config("train", None, [*given, "train.steps=3"])
        assert (mine.optim.lr, mine.optim.warmup_steps, mine.rl.prompts_per_rank) == (1e-6, 0, 4)
        assert mine.model.lora.target_modules == "all-linear"
        assert said == [f"{', '.join(sorted(given))}, train.steps=3 (command line)",
                        "optim.lr=1e-06 (the defaults for a pretrained model)"]
    (tmp_path / "job.yaml").write_text("optim:\n  lr: 2.0e-5\nrl:\n  dataset: prompts.jsonl\n  reward_fn: my:f\n")
    mine, said = load_job_config("train", tmp_path / "job.yaml", ["model.path=/models/mine"])
    assert mine.optim.lr == 2e-5 and said == ["model.path=/models/mine (command line)",
                                              f"optim.lr=2e-05, rl.dataset=prompts.jsonl, rl.reward_fn=my:f "
                                              f"({tmp_path / 'job.yaml'})"]


def _assert_evaluated(tmp_path, proc) -> None:
    """Issue 68 (8): held-out prompts (5: the two ranks take 3 and 2) sampled by the policy and scored with the job's
    reward functions at steps 0, 1 and 2, logged as eval/... rows beside the steps' (the summary says the first and
    last), every sample counted once."""
    from syncwise.metrics import job_history

    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    evaluations = [row for row in rows if "eval/reward/mean" in row]
    assert [row["train/step"] for row in evaluations] == [0, 1, 2]
    for row in evaluations:
        assert row["eval/samples"] == 5 * 4  # rl.samples_per_prompt each
        assert {"eval/reward/correct", "eval/reward/short_even", "eval/response/length_mean"} <= set(row)
        assert row["eval/reward/short_even"] < 0
    history = job_history(tmp_path / "out" / "metrics.jsonl")
    assert [row["train/step"] for row in history] == [0, 1, 2] and "reward/mean" in history[1]
    assert "eval/reward/mean" in history[1] and "eval/reward/mean" in history[2]
    assert "; held out (rl.eval_dataset) " in proc.stdout and " at step 0, " in proc.stdout


def test_rl_eval_dataset_beside_rollout_ranks_is_one_line():
    from syncwise.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^rl.eval_dataset: the trainers sample the evaluation with a rollout copy"):
        load_config(None, ["rl.dataset=p.jsonl", "rl.reward_fn=m:f", "rl.eval_dataset=e.jsonl", "dist.nproc=4",
                           "dist.rollout_ranks=2"])


def test_samples_no_function_scored_are_counted():
    import torch

    from syncwise.rl.stats import _all_none

    nan = float("nan")
    parts = {"a": torch.tensor([nan, 1.0, nan]), "b": torch.tensor([nan, nan, 2.0])}
    assert _all_none(parts) == 1.0 and _all_none({}) == 0.0


def test_async_reward_functions_are_awaited_side_by_side_as_trl_awaits_them():
    """Issue 77 (9): TRL awaits `async def` reward functions, all of a batch side by side; they passed the check
    and then failed at the first scoring ('coroutine' object is not iterable). Two async TRL functions that each
    wait for the other to have started -- finished only if they run side by side, whatever the timing -- an async
    per-sample function, and a sync one between them, called in this thread."""
    import asyncio
    import threading

    started: dict[str, asyncio.Event] = {}

    async def waits_for(other: str, name: str, completions) -> list[float]:
        started.setdefault(name, asyncio.Event()).set()
        await started.setdefault(other, asyncio.Event()).wait()
        return [float(len(c)) for c in completions]

    async def first(completions, **kwargs):
        return await waits_for("second", "first", completions)

    async def second(completions, **kwargs):
        return [-v for v in await waits_for("first", "second", completions)]

    async def each(prompt, response, row):
        await asyncio.sleep(0)
        return 1.0 if response == "ab" else None

    caller = []

    def sync(completions, **kwargs):
        caller.append(threading.current_thread())
        return [0.5] * len(completions)

    functions = [RewardFunction("first", "rl.reward_fn", first), RewardFunction("sync", "rl.reward_fn", sync),
                 RewardFunction("second", "rl.reward_fn", second, 2.0), RewardFunction("each", "rl.reward_fn", each)]
    for _ in range(2):  # the job's loop is kept: a second batch is awaited on it too
        started.clear()
        totals, parts = score(functions, ["q"] * 3, ["a", "ab", "abc"], [{"prompt": "q"}] * 3,
                              state=RewardState(1, 10))
        assert parts["first"] == [1.0, 2.0, 3.0] and parts["second"] == [-1.0, -2.0, -3.0]
        assert parts["each"][1] == 1.0 and math.isnan(parts["each"][0]) and caller[-1] is threading.main_thread()
        assert totals == [1.0 - 2.0 + 0.5, 2.0 - 4.0 + 0.5 + 1.0, 3.0 - 6.0 + 0.5]


def test_an_async_reward_that_raises_and_a_trl_reward_that_returns_a_string_are_one_line():
    """Issue 77 (9, 10): an awaited function's exception names it as a called one's does; a TRL function that
    returns a string was read character by character (one reward a character): refused, naming it."""
    async def broken(completions, **kwargs):
        raise KeyError("answer")

    async def each(prompt, response, row):
        raise ValueError("no")

    def text(completions, **kwargs):
        return "1.0"

    with pytest.raises(ValueError, match=r"^rl.reward_fn: broken raised KeyError: 'answer'$"):
        score([RewardFunction("broken", "rl.reward_fn", broken)], ["q"], ["a"], [{"prompt": "q"}])
    with pytest.raises(ValueError, match=r"^rl.reward_fn: raised ValueError: no \(prompt 'q', response 'a'\)$"):
        score([RewardFunction("each", "rl.reward_fn", each)], ["q"], ["a"], [{"prompt": "q"}])
    with pytest.raises(ValueError, match=r"^rl.reward_fn: text: returned '1.0', not a list of rewards \(one number "):
        score([RewardFunction("text", "rl.reward_fn", text)], ["q"] * 3, ["a", "b", "c"], [{"prompt": "q"}] * 3)
