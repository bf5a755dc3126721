"""Issue 70: the agent people already have, written against OpenAI's API with the real ``openai`` package, trained
unchanged through ``rl.agent`` -- an OpenAI-compatible endpoint on each sampling process, token in and token out.

Real jobs on 2 gloo ranks on the memorised tool model (a tiny Qwen2 that calls ``add`` and answers): a calculator
agent using ``tools=`` and ``tool_calls`` trains with the sampled tokens exactly (each request's prompt ids extend the
last answer's, the trainer's log-probs the sampler's); a history-rewriting agent gives segments; agents that raise,
hang, send malformed or unauthorised requests, run past the context or never call the model are counted on rollout
ranks of their own and the job goes on; 64 concurrent sessions a rank keep their rewards and prompts. Then the
endpoint's contract alone (key, errors, batching), the sessions' token bookkeeping against the chat template, and
``syncwise serve`` with Ctrl-C; vLLM's path where it is installed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from job_output import failed
from syncwise.config.rollout_engines import ROLLOUT_ENGINES
from tool_model_jobs import completions_table, metric_rows, train

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "One number."},
                                     "b": {"type": "integer", "description": "The other."}},
    "required": ["a", "b"]}}}]
CONVERSATION = [
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 7}}}]},
    {"role": "tool", "name": "add", "content": "19"},
    {"role": "assistant", "content": "It is 19.\n#### 19"},
]
# As users write one with the openai package: the client it is given, tools=, tool_calls answered, a loop
CALC_AGENT = '''
import json
import os

TOOLS = TOOLS_JSON


async def agent(row, client, model):
    messages, requests = list(row["prompt"]), []
    for _ in range(4):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=64,
                                                        extra_body={"return_token_ids": True})
        choice = response.choices[0]
        requests.append({"prompt": response.model_extra["prompt_token_ids"], "tokens": choice.model_extra["token_ids"]})
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls:
            break
        for call in choice.message.tool_calls:
            try:  # a sampled call may name other arguments: the tool answers with the error, as agents do
                args = json.loads(call.function.arguments)
                content = str(int(args["a"]) + int(args["b"]))
            except (KeyError, TypeError, ValueError) as exc:
                content = f"error: {exc!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": content})
    with open(os.environ["AGENT_LOG"] + f".{os.getpid()}", "a") as log:
        log.write(json.dumps(requests) + "\\n")
    return None  # rl.reward_fn scores the final conversation
'''.replace("TOOLS_JSON", json.dumps(TOOLS))
# One behaviour a run, by the process's count: what goes wrong with real agents
CHAOS_AGENT = '''
import asyncio
import itertools
import json
import os

import httpx
import openai

ROUTES = {"chat": "chat/completions", "text": "completions"}

runs = itertools.count()


def note(what):
    with open(os.environ["AGENT_LOG"], "a") as log:
        log.write(what + "\\n")


async def agent(row, client, model, base_url, api_key):
    kind = next(runs) % 8
    question = list(row["prompt"])
    if kind == 0:  # a plain run
        await client.chat.completions.create(model=model, messages=question, max_tokens=8)
    elif kind == 1:  # its history rewritten: the second request does not extend the first answer
        first = await client.chat.completions.create(model=model, messages=question, max_tokens=8)
        await client.chat.completions.create(model=model, max_tokens=8, messages=question + [
            {"role": "assistant", "content": "Let me think again."}, {"role": "user", "content": "Go on."}])
    elif kind == 2:
        raise RuntimeError("the agent's own bug")
    elif kind == 3:
        await asyncio.sleep(120)  # hangs: rl.agent_timeout_s cancels it
    elif kind == 4:  # malformed: every bad field (each a 400), then a stream it may not ask for, re-raised
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}",
                                                                 "Content-Type": "application/json"}) as http:
            for kind_, body, param in BAD_REQUESTS_JSON:
                answer = await http.post(ROUTES[kind_], content=json.dumps(body))
                note(f"{answer.status_code} {answer.json()['error']['param']}")
        try:
            await client.chat.completions.create(model=model, messages=question, stream=True)
        except openai.BadRequestError as exc:
            note(f"400 {exc.body['param']}")
            raise
    elif kind == 5:  # another key: refused
        try:
            await openai.AsyncOpenAI(base_url=base_url, api_key="sk-stolen", max_retries=0).models.list()
        except openai.AuthenticationError as exc:
            note(f"401 {exc.body['code']}")
        return 1.0
    elif kind == 6:
        return 0.5  # never calls the model
    else:  # past the model's context (512 positions): finish_reason length, nothing sampled
        long = [{"role": "user", "content": "1 " * 600}]
        response = await client.chat.completions.create(model=model, messages=long, max_tokens=4000)
        note(f"finish {response.choices[0].finish_reason}")
    return None
'''
# Each run says which row it serves in its own system prompt and returns that row's number: a sync function with a
# client of its own, as LangGraph-style code makes one from the URL it is given
ECHO_AGENT = '''
import openai


def agent(row, base_url, api_key, model):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": f"session of row {row['answer']}"}, *row["prompt"]]
    client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    return float(row["answer"])
'''
JOB = ["rl.reward_fn=syncwise.rewards:final_number", "rl.max_new_tokens=64", "rl.prompts_per_rank=2",
       "rl.samples_per_prompt=4", "optim.lr=1e-4", "optim.warmup_steps=0", "train.export=false",
       "train.progress=false", "train.checkpoint_every=0", "rl.dataset=prompts.jsonl"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from user_models import memorized_tool_model

    root = tmp_path_factory.mktemp("agent_job")
    memorized_tool_model(root, CONVERSATION, TOOLS)
    (root / "calc_agent.py").write_text(CALC_AGENT)
    bad = f"json.loads({json.dumps(BAD_REQUESTS)!r})"
    (root / "chaos_agent.py").write_text(CHAOS_AGENT.replace("BAD_REQUESTS_JSON", bad))
    (root / "echo_agent.py").write_text(ECHO_AGENT)
    rows = [{"prompt": CONVERSATION[:1], "answer": "19"}] * 4
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    numbered = [{"prompt": [{"role": "user", "content": f"What is {i} + 7?"}], "answer": str(i)} for i in range(16)]
    (root / "numbered.jsonl").write_text("".join(json.dumps(r) + "\n" for r in numbered))
    return root


def _train(folder: Path, out: str, *overrides: str) -> subprocess.CompletedProcess:
    proc = train(folder, out, JOB, *overrides, env={"AGENT_LOG": str(folder / f"{out}.log")})
    assert proc.returncode == 0, failed(proc.stderr, 3000)
    return proc


@pytest.fixture(scope="module")
def calc(folder):
    """The calculator agent's job, 3 steps, a checkpoint after the second."""
    return _train(folder, "calc", "rl.agent=calc_agent.py:agent", "train.steps=3", "train.checkpoint_every=2")


def test_an_openai_client_agent_trains_on_exactly_the_tokens_the_endpoint_returned(folder, calc):
    proc = calc
    assert "rl.agent calc_agent.py:agent through an OpenAI-compatible endpoint on loopback" in proc.stdout
    rows = metric_rows(folder, "calc")
    for row in rows:
        # the calculator conversations go call -> answer -> final turn, and score as the rl.tools job's do
        assert row["agent/segments"] == 16 and row["agent/rewritten"] == 0 and row["agent/exceptions"] == 0, row
        assert row["agent/inserted_tokens"] > 0 and row["agent/sampled_tokens"] > 0, row
        assert row["agent/requests"] >= 16 + 8, row  # most runs call the tool, then answer
        assert row["reward/mean"] > 0.2, row
        # issue 80 (4): a single reward function's own mean is logged too (the agents' runs return None: all its)
        assert row["reward/final_number"] == pytest.approx(row["reward/mean"], abs=1e-9), row
        # the trainer's forward of the whole conversation gives the sampler's log-probs: nothing re-tokenised
        assert row["rollout/log_prob_diff"] < 2e-6 and row["rollout/log_prob_diff_max"] < 2e-5, row
    runs = [json.loads(line) for log in folder.glob("calc.log.*") for line in log.read_text().splitlines()]
    assert len(runs) == 3 * 16
    for requests in runs:
        for before, after in zip(requests, requests[1:], strict=False):
            # token in: each request's prompt is the last prompt and the tokens returned for it, extended
            so_far = before["prompt"] + before["tokens"]
            assert after["prompt"][:len(so_far)] == so_far
    # token out: what trained after each conversation's first prompt is exactly what the endpoint returned and put
    # between (the completions table's lengths, every step's sample)
    trained = sorted(length for step in (1, 2, 3) for length in completions_table(folder, "calc", step)["length"])
    returned = sorted(len(r[-1]["prompt"]) + len(r[-1]["tokens"]) - len(r[0]["prompt"]) for r in runs)
    assert trained == returned
    assert sum(r["agent/sampled_tokens"] for r in rows) == sum(len(q["tokens"]) for r in runs for q in r)
    table = completions_table(folder, "calc", 3)
    assert table["completion"].str.contains("-> tool call add(", regex=False).any()


def test_a_resumed_agent_job_draws_what_the_job_that_ran_through_did(folder, calc):
    """Issue 77 (left from earlier): each turn's seed is the job's, the step's, the rank's, the session's sample's
    and the turn's -- not the order the agents' requests came in -- and each request draws by its own seed
    whatever was batched beside it: step 3 resumed from step 2's checkpoint samples the conversations the job that
    ran through did, token for token, and trains alike."""
    _train(folder, "calc_resumed", "rl.agent=calc_agent.py:agent", "train.steps=3",
           f"train.resume={folder / 'calc' / 'checkpoints' / 'step_000002'}")
    through, resumed = completions_table(folder, "calc", 3), completions_table(folder, "calc_resumed", 3)
    assert len(resumed) == 2 * 8 and len(set(through["completion"])) > 2  # the draws differ from sample to sample
    for column in ("prompt", "completion", "length", "reward"):
        assert through[column].tolist() == resumed[column].tolist(), column
    (a,), (b,) = metric_rows(folder, "calc")[2:], metric_rows(folder, "calc_resumed")
    assert b["train/step"] == 3 and b["agent/sampled_tokens"] == a["agent/sampled_tokens"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_rewrites_and_faults_are_counted_on_rollout_ranks_and_the_job_goes_on(folder):
    """8 runs a rollout rank, one of each: plain, history rewritten, raises, hangs (cancelled at
    rl.agent_timeout_s), a stream request (400), another key (401), never calls the model, past its budget."""
    proc = _train(folder, "chaos", "rl.agent=chaos_agent.py:agent", "train.steps=2", "rl.agent_timeout_s=5",
                  "dist.nproc=4", "dist.rollout_ranks=2", "rl.max_new_tokens=24")
    # what failed is said, not only counted: a line per kind of failure, with the first one's words
    said = re.findall(r"syncwise train: rl\.agent: (\d+) of 8 run\(s\) for rank \d failed this step .*; the first: "
                      r"sample \d: (\w+)", proc.stdout)
    assert said and all(int(n) == 3 for n, _ in said), proc.stdout  # raised, stream (re-raised), hung
    for step, row in enumerate(metric_rows(folder, "chaos"), start=1):
        counts = {k.removeprefix("agent/"): v for k, v in row.items() if k.startswith("agent/")}
        assert counts["exceptions"] == 4 and counts["timeouts"] == 2, counts  # raised; the stream's re-raised
        assert counts["rewritten"] == 2 and counts["segments"] == 18, counts  # a new segment, trained on its own
        assert counts["malformed"] == 2 * (1 + len(BAD_REQUESTS)) and counts["unauthorized"] == 2, counts
        assert counts["no_requests"] == 10, counts  # the raising, hanging, stream, 401 and never-calling runs
        assert counts["length"] >= 2 and counts["too_long"] == 2, counts  # answered, not trained
        table = completions_table(folder, "chaos", step)
        assert len(table) == 18
        assert sorted(table["reward/agent"].dropna().tolist()) == [0.0] * 6 + [0.5, 0.5, 1.0, 1.0], table  # failed: 0
    notes = (folder / "chaos.log").read_text().splitlines()
    bad = [f"400 {param}" for _, _, param in BAD_REQUESTS]
    assert sorted(notes) == sorted(["400 stream", "401 invalid_api_key", "finish length", *bad] * 4)


def test_64_concurrent_sessions_a_rank_keep_their_rows_and_a_lag_trains_them(folder):
    _train(folder, "echo", "rl.agent=echo_agent.py:agent", "rl.dataset=numbered.jsonl", "rl.prompts_per_rank=8",
           "rl.samples_per_prompt=8", "rl.off_policy_lag=1", "train.steps=2")
    rows = metric_rows(folder, "echo")
    assert all(r["agent/requests"] == 128 and r["agent/segments"] == 128 for r in rows)
    for step in (1, 2):
        table = completions_table(folder, "echo", step)
        assert len(table) == 128
        # every reward on the segment its own session sampled: the prompt it sent names the row it was given
        said = table["prompt"].str.extract(r"session of row (\d+)")[0].astype(float)
        assert (said == table["reward"]).all() and (table["staleness"] == min(step - 1, 1)).all()


@pytest.mark.parametrize(("override", "said"), [
    ("rl.tools=[calculator]", "rl.agent with rl.tools: the agent brings its own tools"),
    ("rl.max_staleness=1", "rl.agent with rl.max_staleness: partial rollouts would carry an agent's run"),
    ("rl.agent=echo_agent.py:missing", "rl.agent: cannot import 'echo_agent.py:missing'"),
    ("rl.agent=bad_agent.py:agent", "rl.agent: bad_agent.py:agent asks for question; an agent is given by name any of"),
])
def test_an_agent_job_s_mistakes_are_one_line_before_any_rank(folder, override, said):
    from cli_harness import run_cli

    (folder / "bad_agent.py").write_text("def agent(row, question):\n    return 0.0\n")
    proc = run_cli(["train", *JOB, f"model.path={folder / 'qwen2-tools'}", "rl.agent=echo_agent.py:agent",
                    override], cwd=folder)
    assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_endpoint_refuses_in_openai_s_shape_and_batches_what_is_queued():
    import httpx

    from syncwise.rl.env.agents import POOL_KEEP_ALIVE_S, AgentFunction
    from syncwise.rl.rollout.endpoint import KEEP_ALIVE_S, Endpoint
    from syncwise.rl.rollout.serving import BATCH_WAIT_S, TurnServer, batch_gap

    async def calc(row, client):
        return None

    endpoint = Endpoint("m")
    endpoint.start()
    try:
        session = endpoint.open_session()
        url = endpoint.base_url(session)
        auth = {"Authorization": f"Bearer {endpoint.key}"}
        refused = httpx.get(f"{url}/models")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        models = httpx.get(f"{url}/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        stream = httpx.post(f"{url}/chat/completions", headers=auth, json={"messages": [], "stream": True})
        assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
        closed = httpx.post(f"{endpoint.base_url('nope')}/completions", headers=auth, json={"prompt": "x"})
        assert closed.status_code == 404 and closed.json()["error"]["code"] == "session_closed"
        assert endpoint.requests.empty() and endpoint.refused == {"unauthorized": 1, "malformed": 1}
        # five requests queued while five agents run: one batch
        for _ in range(5):
            endpoint.requests.put("queued")
        server = TurnServer(endpoint, None, None, {})
        assert len(server.collect(lambda: 5)) == 5
        # with six running, the sixth not coming: the batch goes after the gap, which the engine's last call sets
        for _ in range(5):
            endpoint.requests.put("queued")
        server.gap_s = 0.05
        assert len(server.collect(lambda: 6)) == 5 and endpoint.requests.empty()
        assert (batch_gap(0.01), batch_gap(2.0), batch_gap(60.0)) == (BATCH_WAIT_S, 0.2, 1.0)
        # the agents' pool lets an idle connection go before the server does (else a pool may send on one the
        # server is closing: "Server disconnected" after an update of ~uvicorn's default 5 s)
        pool = AgentFunction("a", calc).http_client(4)
        assert pool._transport._pool._keepalive_expiry == POOL_KEEP_ALIVE_S < KEEP_ALIVE_S
        assert endpoint._server.config.timeout_keep_alive == KEEP_ALIVE_S
    finally:
        endpoint.close()


def test_an_agent_s_reward_is_none_or_a_finite_number_said_in_one_line():
    from syncwise.rl.env.agents import reward_value

    assert reward_value("a.py:f", None) is None and reward_value("a.py:f", 1) == 1.0
    with pytest.raises(ValueError, match=r"^rl.agent: a.py:f returned 'high', not a number \(None: rl.reward_fn "):
        reward_value("a.py:f", "high")
    with pytest.raises(ValueError, match=r"^rl.agent: a.py:f returned inf; a reward must be a finite number"):
        reward_value("a.py:f", float("inf"))


def test_a_batch_of_alike_first_turns_is_sampled_as_n_samples_of_each_prompt():
    from syncwise.rl.rollout.serving import shared_prompts

    # a prompt's runs send the same first turn: each distinct prompt once, n samples, every request its own sample
    prompts, n, place = shared_prompts([[1, 2], [3], [1, 2], [3], [1, 2], [3]])
    assert (prompts, n) == ([[1, 2], [3]], 3) and place == [0, 3, 1, 4, 2, 5]
    # later turns differ, or copies unevenly many: one sample each, in order
    assert shared_prompts([[1], [2], [3]]) == ([[1], [2], [3]], 1, [0, 1, 2])
    assert shared_prompts([[1], [1], [2]]) == ([[1], [1], [2]], 1, [0, 1, 2])


def _ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    from syncwise.rl.rollout.sessions import template_message

    return list(tokenizer.apply_chat_template([template_message(m) for m in messages], tools=TOOLS, return_dict=True,
                                              **kwargs)["input_ids"])


def test_a_session_appends_the_new_messages_tokens_and_opens_a_segment_for_a_rewrite(folder):
    from transformers import AutoTokenizer

    from syncwise.rl.rollout.sessions import Session

    tokenizer = AutoTokenizer.from_pretrained(folder / "qwen2-tools")
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    session = Session(tokenizer, end, 200, 512)
    turn = session.plan_chat(CONVERSATION[:1], TOOLS)
    assert turn.prompt == _ids(tokenizer, CONVERSATION[:1], add_generation_prompt=True)
    # the model's turn as the template would write it, sampled: the template's own tokens
    whole = _ids(tokenizer, CONVERSATION[:2])
    sampled = whole[len(turn.prompt):whole.index(end[0], len(turn.prompt)) + 1]
    session.take(turn, sampled, [0.0] * len(sampled), None, True, 0)
    parsed = session.answer(turn, tokenizer.decode(sampled[:-1]), TOOLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 12, "b": 7})]
    openai_call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 7}'}}
    history = [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [openai_call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "19"}]
    turn = session.plan_chat(history, TOOLS)
    # token in: the sequence is the template's rendering of the conversation so far, nothing re-tokenised
    assert turn.prompt == _ids(tokenizer, history, add_generation_prompt=True)
    trajectory = session.current.trajectory
    assert trajectory.sampled == [1] * len(sampled) + [0] * (len(trajectory.tokens) - len(sampled))
    assert session.counts["inserted_tokens"] == len(trajectory.tokens) - len(sampled) > 0
    session.take(turn, sampled[:1], [0.0], None, False, 0)  # answered before the agent goes on
    session.plan_chat([CONVERSATION[0], {"role": "assistant", "content": "no call"}, CONVERSATION[0]], TOOLS)
    assert len(session.segments) == 2 and session.counts["rewritten"] == 1


def test_syncwise_serve_answers_the_openai_client_and_stops_on_ctrl_c(folder):
    import openai

    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell's ignored SIGINT not inherited
    try:
        proc = subprocess.Popen([sys.executable, "-m", "syncwise", "serve", f"model.path={folder / 'qwen2-tools'}",
                                 "--port", "0"], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "SYNCWISE_API_KEY": "sk-test"})
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        line = proc.stdout.readline()
        base_url = re.search(r"at (http://127\.0\.0\.1:\d+/v1) \(api_key sk-test\)", line).group(1)
        client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
        chat = client.chat.completions.create(model="qwen2-tools", messages=CONVERSATION[:1], tools=TOOLS,
                                              max_tokens=64, logprobs=True, extra_body={"return_token_ids": True})
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "add"
        assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"]) > 0
        assert chat.model_extra["prompt_token_ids"]
        assert chat.usage.completion_tokens == len(choice.model_extra["token_ids"])
        text = client.completions.create(model="qwen2-tools", prompt=[1, 2, 3], max_tokens=3,
                                         extra_body={"return_token_ids": True})
        assert text.choices[0].model_extra["prompt_token_ids"] == [1, 2, 3]
        assert len(text.choices[0].model_extra["token_ids"]) == text.usage.completion_tokens
        # vLLM's contract: the ids only where asked for (null otherwise), log-probs only where asked for
        plain = client.chat.completions.create(model="qwen2-tools", messages=CONVERSATION[:1], max_tokens=8)
        assert plain.model_extra["prompt_token_ids"] is None and plain.choices[0].model_extra["token_ids"] is None
        assert plain.choices[0].logprobs is None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "syncwise serve: stopped" in err and "Traceback" not in err


@pytest.mark.skipif(not ROLLOUT_ENGINES["vllm"].installed(), reason="vLLM is not installed (make install brings it)")
def test_the_agent_job_samples_on_vllm(folder):
    proc = _train(folder, "calc_vllm", "rl.agent=calc_agent.py:agent", "train.steps=1", "rl.rollout_engine=vllm")
    assert "rollouts by vLLM" in proc.stdout
    (row,) = metric_rows(folder, "calc_vllm")
    assert row["agent/segments"] == 16 and row["agent/rewritten"] == 0 and row["agent/requests"] >= 24, row
    assert row["rollout/log_prob_diff"] < 1e-3, row  # vLLM's float32 CPU kernels against the trainer's


# Issue 77 (6, 7): every kind of bad field a client can send, and the param OpenAI's 400 names (None: the body)
BAD_REQUESTS = [
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": []}, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stop": [7]}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}, "seed"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, "logprobs"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [5]}]}, "messages"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": {"a": 1}}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": "add"}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, None),
    ("text", {"prompt": [10 ** 9]}, "prompt"),
    ("text", {"prompt": [-1]}, "prompt"),
    ("text", {"prompt": [1, "a"]}, "prompt"),
    ("text", {"prompt": "\ud800"}, None),
    ("text", [1, 2], None),
]
ROUTES = {"chat": "chat/completions", "text": "completions"}


class _Serving:
    """An endpoint on a model folder answered by the real rollout engine, as ``syncwise serve`` and an agent job
    answer it, in a thread: each engine call waits until ``batch`` requests are queued (no timing decides what is
    sampled together). ``sessions``: the session of each ``/s/<id>`` base URL."""

    def __init__(self, model: Path, batch: int = 1, stateless: bool = False):
        from syncwise.config import load_job_config
        from syncwise.rl.rollout.endpoint import Endpoint
        from syncwise.rl.rollout.serving import TurnServer
        from syncwise.rl.serve import load_served

        config, _ = load_job_config("serve", None, [f"model.path={model}", "rl.max_new_tokens=32"])
        self.served = load_served(config)
        self.endpoint = Endpoint("m", stateless=stateless)
        self.server = TurnServer(self.endpoint, self.served.engine, self.served.tokenizer,
                                 {"temperature": 1.0, "top_p": 1.0})
        self.batch, self.sessions, self.batches = batch, {}, []

    def open(self) -> str:
        sid = self.endpoint.open_session()
        self.sessions[sid] = self.served.session()
        return self.endpoint.base_url(sid)

    def __enter__(self):
        import threading

        self.endpoint.start()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        calls = 0
        while not self.stop.is_set():
            if self.endpoint.requests.qsize() < self.batch:
                self.stop.wait(0.005)
                continue
            batch = [self.endpoint.requests.get() for _ in range(self.batch)]
            self.batches.append(len(batch))
            self.server.answer(batch, lambda sid: self.sessions.get(sid) or self.served.session(), 0,
                               lambda k, _session, _turn, first=1000 * calls: first + k)
            calls += 1

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)
        self.endpoint.close()

    def post(self, url: str, kind: str, body, **extra) -> tuple[int, dict]:
        import httpx

        response = httpx.post(f"{url}/{ROUTES[kind]}", content=json.dumps(body),  # ASCII JSON: a lone surrogate too
                              headers={"Authorization": f"Bearer {self.endpoint.key}",
                                       "Content-Type": "application/json"}, timeout=120, **extra)
        return response.status_code, response.json()

    def side_by_side(self, requests: list[tuple[str, str, dict]]) -> list[tuple[int, dict]]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda r: self.post(*r), requests))


def test_requests_of_one_session_sent_side_by_side_each_train_their_own_tokens(folder):
    """Issue 77 (1): two requests of one session in one engine call -- the first opened segment 0, the second
    segment 1, then both answers went to segment 1 (segment 0 trained nothing, segment 1 another context's
    tokens). Each segment now trains exactly its own request's sampled ids, chat and completions alike; a later
    request extends the conversation it continues."""
    with _Serving(folder / "qwen2-tools", batch=2) as serving:
        url = serving.open()
        session = serving.sessions[url.split("/s/")[1].split("/")[0]]
        first = [{"role": "user", "content": "What is 12 + 7?"}]
        second = [{"role": "user", "content": "What is 3 + 4?"}]
        answers = serving.side_by_side([(url, "chat", {"messages": m, "max_tokens": 6, "return_token_ids": True})
                                        for m in (first, second)])
        assert [status for status, _ in answers] == [200, 200] and serving.batches == [2], answers
        prompts = [a["prompt_token_ids"] for _, a in answers]
        sampled = [a["choices"][0]["token_ids"] for _, a in answers]
        assert len(session.segments) == 2 and session.counts["concurrent"] == 1
        by_prompt = {tuple(s.trajectory.prompt): s.trajectory for s in session.segments}
        for prompt, tokens in zip(prompts, sampled, strict=True):
            trajectory = by_prompt[tuple(prompt)]
            assert trajectory.tokens == tokens and trajectory.sampled == [1] * len(tokens)
        # completions: the same, by token ids
        texts = serving.side_by_side([(url, "text", {"prompt": p, "max_tokens": 5, "return_token_ids": True})
                                      for p in ([5, 6, 7], [8, 9])])
        assert len(session.segments) == 4
        for (_, answer), segment in zip(texts, sorted(session.segments[2:], key=lambda s: -len(s.trajectory.prompt)),
                                        strict=True):
            assert segment.trajectory.tokens == answer["choices"][0]["token_ids"]
        # the first conversation goes on in its own segment (not the newest), the second stays as it was
        serving.batch = 1
        opened = dict(session.counts)
        reply = answers[0][1]["choices"][0]["message"]
        status, _ = serving.post(url, "chat", {"messages": [*first, {"role": "assistant", "content": reply["content"]},
                                                            {"role": "user", "content": "And 1 + 1?"}],
                                               "max_tokens": 4})
        assert status == 200 and len(session.segments) == 4
        assert all(session.counts[k] == opened[k] for k in ("rewritten", "concurrent"))
        extended = by_prompt[tuple(prompts[0])]
        assert extended.tokens[:len(sampled[0])] == sampled[0] and len(extended.tokens) > len(sampled[0])
        assert by_prompt[tuple(prompts[1])].tokens == sampled[1]


def test_every_bad_field_is_a_400_naming_it_and_the_server_answers_the_next(folder):
    """Issue 77 (6, 7): a malformed field (temperature "hot", stop 5, a tool call that is no object), token ids
    outside the vocabulary or a lone surrogate raised in the sampling thread, ending `syncwise serve` or the rank.
    Each is OpenAI's 400 naming the field, sent beside a good request of another session, which is answered."""
    with _Serving(folder / "qwen2-tools", batch=1) as serving:
        good, bad = serving.open(), serving.open()
        for kind, body, param in BAD_REQUESTS:
            [(status, answer), (ok, _)] = serving.side_by_side([
                (bad, kind, body), (good, "chat", {"messages": CONVERSATION[:1], "max_tokens": 2})])
            assert (status, answer["error"]["param"], ok) == (400, param, 200), (kind, body, answer)
            assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
        assert serving.thread.is_alive()


def test_a_request_near_the_context_is_sampled_within_its_own_room(tmp_path):
    """Issue 77 (8): a batch was sampled for its largest room, so a prompt that nearly filled GPT-2's 64 learned
    positions, beside a short one, was sampled past them (IndexError: the server died). Each request gets its own
    room: the long one ends at the context (finish_reason length), the short one has its tokens."""
    from user_models import save_model_dir

    model = save_model_dir(tmp_path, "gpt2", positions=64)
    with _Serving(model, batch=2, stateless=True) as serving:
        url = serving.endpoint.base_url()
        [(long_status, long), (short_status, short)] = serving.side_by_side([
            (url, "text", {"prompt": list(range(5, 65)), "max_tokens": 30, "return_token_ids": True}),
            (url, "text", {"prompt": [5, 6], "max_tokens": 30, "return_token_ids": True})])
        assert (long_status, short_status) == (200, 200) and serving.batches == [2], (long, short)
        assert len(long["choices"][0]["token_ids"]) <= 4
        assert 1 <= len(short["choices"][0]["token_ids"]) <= 30
        assert serving.thread.is_alive()


def test_serve_takes_keys_after_options_names_a_missing_folder_and_prints_the_url_it_listens_on(tmp_path):
    """Issue 77 (10): `serve model.path=DIR --port 8000 rl.temperature=0.7` failed with 'unrecognized arguments'; a
    missing model.path was answered with a hub repo-id error; `--host 0.0.0.0` printed a 127.0.0.1 URL."""
    import socket

    from cli_harness import run_cli
    from syncwise.rl.rollout.endpoint import Endpoint

    missing = tmp_path / "no-model"
    proc = run_cli(["serve", f"model.path={missing}", "--port", "0", "rl.temperature=0.7"])
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"syncwise: config error: model.path: no such folder: {missing} (syncwise serve takes a model folder: a "
        "job's export, or save_pretrained's)"), proc.stderr
    wrong = run_cli(["serve", f"model.path={missing}", "--port", "0", "--nope"])
    assert wrong.returncode == 2 and "unrecognized arguments: --nope" in wrong.stderr
    endpoint = Endpoint("m")
    endpoint.start("0.0.0.0", 0)
    try:
        assert endpoint.base_url() == f"http://{socket.gethostname()}:{endpoint.port}/v1"
    finally:
        endpoint.close()


def test_an_agent_job_whose_every_run_fails_the_same_way_stops_with_that_reason(folder):
    """Issue 80 (4): every run raised the same error, so nothing trained, and the job ended with the engine's
    'loss_mask ... leaves no target token' -- the reason lost. It stops with the first run's words."""
    (folder / "broken_agent.py").write_text("def agent(row, base_url):\n    return row['missing_column']\n")
    proc = train(folder, "broken", JOB, "rl.agent=broken_agent.py:agent", "train.steps=2")
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"^syncwise: error: rl\.agent: all 8 run\(s\) for rank [01] failed this step, every one the "
                     r"same way; the first: sample 0: KeyError: 'missing_column'$", proc.stderr, re.M), \
        failed(proc.stderr, 2000)  # whichever rank says it first
    assert "leaves no target token" not in proc.stderr
