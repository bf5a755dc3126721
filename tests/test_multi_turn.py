"""Multi-turn rollouts with tools (issue 40), the parts one process pins down: the calculator, loading a
user's tools and running them whatever they do, parsing calls in Qwen2.5's and Llama-3.1's formats, and the
conversation loop on real templates -- trained tokens exactly the assistant spans, the whole sequence the
template's rendering of the conversation, the engine asked one turn at a time. A scripted engine stands in
for sampling here (it pins the call sequence); tests/test_tool_jobs.py runs real models on 2 ranks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from syncwise.config import load_config
from syncwise.rewards import final_number
from syncwise.rl.env.base import FunctionTools
from syncwise.rl.env.prompts import encode_prompt, encode_prompts
from syncwise.rl.env.tool_calls import choose_parser, parse_turn
from syncwise.rl.env.tools import ToolLimits, ToolRunner, load_tools, run_tool
from syncwise.rl.rollout.base import Samples
from syncwise.rl.rollout.turns import TurnLoop
from syncwise.tools import calculator
from user_models import llama31_tokenizer, qwen25_tokenizer


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculator("48 * 127 + 395") == "6491"
    assert calculator("(1234 + 567) * 89 / 4") == "40072.25"
    assert calculator(" 7 // 2 + 7 % 2 - -3 ") == "7"
    assert calculator("2 ** 10") == "1024" and calculator("1 / 3") == repr(1 / 3)
    assert calculator("0.1 + 0.2") == "0.3" and calculator("0.5 ** 300") == repr(0.5**300)  # decimals as written
    for bad, error in [("__import__('os').system('true')", ValueError), ("1 / 0", ZeroDivisionError),
                       ("9 ** 9 ** 9", ValueError), ("10 ** 101", ValueError), ("x + 1", ValueError),
                       ("[1] * 3", ValueError), ("True + 1", ValueError), ("1if 2", SyntaxError)]:
        with pytest.raises(error):
            calculator(bad)


@pytest.mark.parametrize(("expression", "said"), [
    ("0.1 ** 1000", "too small"), ("2 ** -500", "too small"),  # tiny, not "too large"
    ("1 / 10 ** 60 / 10 ** 60", "too small"),
    ("(1.0001 ** 999) ** 999", "too many digits"),  # 22 characters: ~14M-bit numbers, computed for minutes before
    ("(1.0001 ** 99) ** 999", "too many digits"), ("1e400 * 1", "too large"),
])
def test_calculator_answers_tiny_and_huge_results_at_once(expression, said):
    start = time.process_time()
    with pytest.raises(ValueError, match=said):
        calculator(expression)
    assert time.process_time() - start < 1  # refused before computing (measured: well under a millisecond)


TOOLS_PY = '''
import time

def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b

def shout(text: str) -> str:
    """Raise, always.

    Args:
        text: Anything.
    """
    raise RuntimeError("no " + text)

def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"

def untyped(x) -> str:
    """Untyped.

    Args:
        x: Anything.
    """
    return str(x)

def undocumented(x: int) -> str:
    return str(x)

NOT_A_FUNCTION = 3
'''


@pytest.fixture()
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_PY)
    return path


def test_loading_tools_says_what_is_wrong_in_one_line(tools_file):
    tools = load_tools(["calculator", f"{tools_file}:add"])
    assert list(tools) == ["calculator", "add"]
    assert tools["add"].schema["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                                "description": "The first."}
    for entry, said in [(f"{tools_file}:NOT_A_FUNCTION", "is not callable"),
                        ("math:sqrt", "not a function"),
                        (f"{tools_file}:untyped", "parameter(s) x have no type hint"),
                        (f"{tools_file}:undocumented", "Google-style docstring"),
                        (f"{tools_file}:missing", "cannot import"),
                        ("no_such_module_here:f", "cannot import")]:
        with pytest.raises(ValueError, match="rl.tools") as info:
            load_tools([entry])
        assert said in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        load_tools([f"{tools_file}:add", f"{tools_file}:add"])


def test_a_tool_that_fails_answers_with_its_error(tools_file):
    tools = load_tools([f"{tools_file}:add", f"{tools_file}:shout", f"{tools_file}:nap"])
    added = run_tool(tools, "add", {"a": 2, "b": 3}, 5)
    assert (added.content, added.error, added.kinds) == ("5", None, ("json_answers",))  # JSON: counted apart
    raised = run_tool(tools, "shout", {"text": "way"}, 5)
    assert (raised.content, raised.error) == ("error: RuntimeError: no way", "exception")
    start = time.perf_counter()
    hung = run_tool(tools, "nap", {"seconds": 30}, 0.2)
    assert hung.error == "timeout" and "within 0.2 s" in hung.content and time.perf_counter() - start < 10
    assert run_tool(tools, "nap", {"seconds": 0}, 5).content == "rested"
    assert run_tool(tools, "nope", {}, 5).error == "unknown_tool"
    assert run_tool(tools, "add", {"a": 1}, 5).error == "bad_arguments"
    assert run_tool(tools, "add", [1, 2], 5).error == "bad_arguments"


RUNNER_TOOLS = '''
import sys
import threading
import time

def exits(flag: str) -> str:
    """Parse a command line, as argparse does: exit on what it does not take.

    Args:
        flag: A flag.
    """
    sys.exit(2)

def retries(seconds: float) -> str:
    """Retry on every error, as tools do.

    Args:
        seconds: How long each try sleeps.
    """
    global tries
    for _ in range(100):
        try:
            tries += 1
            time.sleep(seconds)
        except Exception:
            continue
    return "done"

tries = 0
together = threading.Barrier(6)

def meet(who: int) -> str:
    """Wait until six calls are here at once.

    Args:
        who: Which call.
    """
    together.wait(timeout=60)
    return f"met {who}"

def answer(kind: str) -> object:
    """Answer something that is not a string.

    Args:
        kind: none, dict, set or long.
    """
    return {"none": None, "dict": {"a": [1, 2]}, "set": {1}, "long": "x" * 10_000}[kind]

def noisy(text: str) -> str:
    """Print, then answer.

    Args:
        text: What to print.
    """
    print(text)
    print("second line", file=sys.stderr)
    return "ok"

release = threading.Event()

def stall() -> str:
    """Wait, blocked in C (a lock's wait), until the test lets go.
    """
    release.wait()
    return "done"

halfway = threading.Barrier(2)

def halves(who: str) -> str:
    """Print a line in two halves while another call prints, then a line left unfinished.

    Args:
        who: Which call.
    """
    print(f"{who}: first half", end="")
    halfway.wait(timeout=60)  # both calls have printed their first halves
    print(", second half")
    halfway.wait(timeout=60)
    print(f"{who} unfinished", end="")
    return "ok"
'''


@pytest.fixture()
def runner_tools(tmp_path):
    path = tmp_path / "runner_tools.py"
    path.write_text(RUNNER_TOOLS)
    tools = load_tools([f"{path}:{name}" for name in ("exits", "retries", "meet", "answer", "noisy", "stall",
                                                       "halves")])
    yield tools, tools["retries"].fn.__globals__
    tools["stall"].fn.__globals__["release"].set()  # no blocked call outlives its test


def test_a_tool_that_exits_is_its_error_and_the_job_goes_on(runner_tools):
    tools, _ = runner_tools
    result = run_tool(tools, "exits", {"flag": "--nope"}, 5)
    assert (result.content, result.error) == ("error: SystemExit: 2", "exception")


def test_the_time_limit_cannot_be_caught_by_the_tool(runner_tools):
    """A tool whose retry loop catches every Exception: the call is answered at its limit, counted, and the
    abandoned thread is stopped at its next bytecode (the loop's except Exception does not catch it)."""
    tools, state = runner_tools
    start = time.perf_counter()
    result = run_tool(tools, "retries", {"seconds": 0.05}, 0.3)
    assert result.error == "timeout" and result.content == "error: retries did not finish within 0.3 s"
    assert time.perf_counter() - start < 4  # 100 tries x 0.05 s would be 5 s: the caller did not wait for them
    thread = next(t for t in threading.enumerate() if t.name == "syncwise-tool-retries")
    thread.join(timeout=60)
    assert not thread.is_alive() and state["tries"] < 100  # stopped, not left retrying


def test_a_turns_calls_run_side_by_side_and_answer_in_order(runner_tools):
    tools, _ = runner_tools
    runner = ToolRunner(ToolLimits(timeout_s=60, workers=6))
    results = runner.run([(tools, "meet", {"who": i}) for i in range(6)])  # each waits until all six run at once
    assert [r.content for r in results] == [f"met {i}" for i in range(6)] and not any(r.error for r in results)


def test_a_steps_tool_time_is_bounded_and_the_calls_past_it_say_so(runner_tools):
    tools, _ = runner_tools
    runner = ToolRunner(ToolLimits(timeout_s=30, step_timeout_s=0.5, workers=1))
    runner.new_step()
    results = runner.run([(tools, "retries", {"seconds": 0.05}), (tools, "answer", {"kind": "none"})])
    assert [r.error for r in results] == ["step_timeout", "step_timeout"]
    assert "the step's rl.tool_step_timeout_s=0.5 s" in results[1].content
    assert runner.run([(tools, "answer", {"kind": "none"})])[0].error == "step_timeout"  # the next turn's too
    runner.new_step()
    assert runner.run([(tools, "answer", {"kind": "none"})])[0].error is None  # a new step, a new budget


def test_answers_are_json_or_cut_and_counted_apart_from_errors(runner_tools):
    tools, _ = runner_tools
    runner = ToolRunner(ToolLimits(max_chars=100))
    none, mapping, a_set, long = runner.run([(tools, "answer", {"kind": k}) for k in ("none", "dict", "set", "long")])
    assert (none.content, none.error, none.kinds) == ("null", None, ("json_answers",))
    assert (mapping.content, mapping.error) == ('{"a": [1, 2]}', None)
    assert (a_set.content, a_set.error) == ("{1}", "non_text")  # not JSON: its text, an error
    assert long.content == "x" * 100 + "\n[truncated: the first 100 of 10000 characters (rl.tool_max_chars)]"
    assert long.error is None and long.kinds == ("truncated_answers",)


def test_what_a_tool_prints_says_which_tool_printed_it(runner_tools, capsys):
    tools, _ = runner_tools
    assert run_tool(tools, "noisy", {"text": "hello\nworld"}, 5).content == "ok"
    out, err = capsys.readouterr()
    assert out == "[tool noisy] hello\n[tool noisy] world\n" and err == "[tool noisy] second line\n"
    print("the job's own line")
    assert capsys.readouterr().out == "the job's own line\n"


def test_calls_parse_in_each_family_format():
    hermes = parse_turn('Let me see.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n'
                        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n'
                        '</tool_call>', "hermes")
    assert hermes.content == "Let me see."
    assert [(c.name, c.arguments) for c in hermes.calls] == [("calculator", {"expression": "2 * 3"}),
                                                             ("add", {"a": 1, "b": 2})]
    broken = parse_turn('<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>', "hermes")
    assert not broken.calls and len(broken.errors) == 1 and "not valid JSON" in broken.errors[0]
    assert parse_turn("The answer is 6.\n#### 6", "hermes").calls_tools is False
    llama = parse_turn('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1; 2"}}; '
                       '{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3_json")
    assert [(c.name, c.arguments) for c in llama.calls] == [("calculator", {"expression": "1; 2"}),
                                                            ("add", {"a": 1, "b": 2})]
    assert parse_turn("It is 6.", "llama3_json").calls_tools is False
    # as a Llama-3.1 turn decodes with its special tokens kept (only the end of the turn dropped)
    tokenizer = llama31_tokenizer()
    ids = tokenizer('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2"}}<|eot_id|>',
                    add_special_tokens=False)["input_ids"]
    assert parse_turn(tokenizer.decode(ids[:-1], skip_special_tokens=False), "llama3_json").calls[0].name == \
        "calculator"
    assert parse_turn('{"name": 3}', "llama3_json").errors


def test_the_parser_comes_from_the_template_and_a_template_without_tools_is_one_line():
    assert choose_parser(qwen25_tokenizer(), "auto") == "hermes"
    assert choose_parser(llama31_tokenizer(), "auto") == "llama3_json"
    from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer

    plain = chat_tokenizer(arith_chat_rows(50, seed=1))  # ChatML without tool support
    with pytest.raises(ValueError, match="does not render tools"):
        choose_parser(plain, "auto")


def test_a_parser_the_template_contradicts_is_one_line():
    assert choose_parser(qwen25_tokenizer(), "hermes") == "hermes"
    with pytest.raises(ValueError, match=r"^rl.tool_parser=llama3_json: the chat template renders tool calls as "
                                         r"hermes \(<tool_call>\{json\}</tool_call>\), .*; set rl.tool_parser=hermes "
                                         r"or auto$"):
        choose_parser(qwen25_tokenizer(), "llama3_json")
    with pytest.raises(ValueError, match=r"^rl.tool_parser=hermes: the chat template renders tool calls as "
                                         r"llama3_json"):
        choose_parser(llama31_tokenizer(), "hermes")


def test_a_tool_file_that_fails_at_import_is_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("import os\nraise RuntimeError('no API key')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit('usage: exits.py')\n")
    for name, said in [("broken", "RuntimeError: no API key"), ("exits", "SystemExit: usage: exits.py")]:
        with pytest.raises(ValueError) as info:
            load_tools([f"{tmp_path / name}.py:tool"])
        assert str(info.value) == f"rl.tools: cannot import '{tmp_path / name}.py:tool': {said}", str(info.value)


class ScriptedEngine:
    """Answers turn k of every conversation with ``script[k]`` and its end token, log-prob -0.5 per token;
    records what it was asked (the call sequence the loop must make)."""

    def __init__(self, tokenizer, script: list[str], end: str):
        self.turns = [tokenizer(text + end, add_special_tokens=False)["input_ids"] for text in script]
        self.calls: list[tuple[list[list[int]], int, int]] = []

    def sample(self, prompts, n, max_new_tokens, seed):
        self.calls.append(([list(p) for p in prompts], n, max_new_tokens))
        turn = self.turns[len(self.calls) - 1]
        tokens = [torch.tensor(turn[:max_new_tokens]) for _ in range(len(prompts) * n)]
        log_probs = [torch.full((len(t),), -0.5) for t in tokens]
        return Samples(tokens, log_probs, 0, [len(turn) <= max_new_tokens] * len(tokens), log_probs)


def _hermes_call(e):
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}\n</tool_call>'


FAMILIES = {
    "qwen2.5": (qwen25_tokenizer, "<|im_end|>", _hermes_call),
    # the call's tags registered as special tokens (some Hermes-style tokenizers): parsed all the same
    "qwen2.5-special-tags": (lambda: qwen25_tokenizer(special_tags=True), "<|im_end|>", _hermes_call),
    "llama3.1": (llama31_tokenizer, "<|eot_id|>",
                 lambda e: f'{{"name": "calculator", "parameters": {{"expression": "{e}"}}}}'),
}
PROMPT = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12 * 7 + 5?"}]


def _call(expression):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}


def _loop(family, script, *overrides, max_new_tokens=600):
    make_tokenizer, end, call = FAMILIES[family]
    tokenizer = make_tokenizer()
    cfg = load_config(None, ["rl.tools=[calculator]", *overrides]).rl
    tools = load_tools(["calculator"])
    schemas = [tools["calculator"].schema]
    prompt_ids = encode_prompt(PROMPT, cfg, tokenizer, schemas)
    engine = ScriptedEngine(tokenizer, [call(s[5:]) if s.startswith("call:") else s for s in script], end)
    loop = TurnLoop(cfg, tokenizer, None, lambda row: FunctionTools(tools), list(tools))
    conversations, _, _ = loop.run(engine, [{"prompt": PROMPT, "answer": "89"}], [prompt_ids], [schemas], 2,
                                   max_new_tokens, seeds=[0] * cfg.max_turns)
    return tokenizer, end, call, schemas, prompt_ids, engine, conversations


def _runs(tokens, flags, value=1):
    """The maximal runs of ``tokens`` whose flag is ``value``."""
    runs, current = [], []
    for token, flag in zip(tokens, flags, strict=True):
        if flag == value:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_three_turn_rollout_trains_exactly_the_assistant_spans(family):
    script = ["call:12 * 7", "call:84 + 5", "It is 89.\n#### 89"]
    tokenizer, end, call, schemas, prompt_ids, engine, conversations = _loop(family, script)
    messages = [_call("12 * 7"), {"role": "tool", "name": "calculator", "content": "84"},
                _call("84 + 5"), {"role": "tool", "name": "calculator", "content": "89"},
                {"role": "assistant", "content": "It is 89.\n#### 89"}]
    # the spans by hand: each assistant turn as the model writes it, through its end-of-turn token
    spans = [tokenizer(text + end, add_special_tokens=False)["input_ids"]
             for text in (call("12 * 7"), call("84 + 5"), "It is 89.\n#### 89")]
    whole = tokenizer.apply_chat_template(PROMPT + messages, tools=schemas, tokenize=False)
    for conversation in conversations:
        assert _runs(conversation.tokens, conversation.sampled) == spans
        # prompt + every turn + the template's text between is the template's rendering of the conversation
        assert tokenizer.decode(prompt_ids + conversation.tokens) == whole.removesuffix("\n")
        between = _runs(conversation.tokens, conversation.sampled, value=0)
        assert all("84" in tokenizer.decode(b) or "89" in tokenizer.decode(b) for b in between)  # the results
        assert conversation.messages == messages
        assert dict(conversation.counts) == {"turns": 3, "tool_calls": 2} and conversation.ended
        # the sampler's log-probs on exactly the sampled tokens
        assert conversation.full_log_probs == [-0.5 if s else 0.0 for s in conversation.sampled]
        assert final_number(PROMPT, conversation.messages, {"answer": "89"}) == 1.0
    # the engine: the prompt once for both samples, then one call per turn over the conversations so far
    assert engine.calls[0] == ([prompt_ids], 2, 600)
    first = conversations[0]
    after_one = len(spans[0]) + len(_runs(first.tokens, first.sampled, value=0)[0])
    assert engine.calls[1][:2] == ([prompt_ids + first.tokens[:after_one]] * 2, 1)
    assert len(engine.calls) == 3 and engine.calls[2][0] == [prompt_ids + first.tokens[:-len(spans[2])]] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bad_call_is_answered_and_counted_and_the_limits_end_a_conversation(family):
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>' \
        if family.startswith("qwen2.5") else '{"name": "calculator", "parameters": {"expression": }'
    tokenizer, *_, conversations = _loop(family, [broken, "call:1 / 0", "It is 89.\n#### 89"])
    counts = conversations[0].counts
    assert (counts["bad_json"], counts["exception"], counts["tool_calls"], counts["turns"]) == (1, 1, 2, 3)
    assert conversations[0].messages[1]["content"].startswith("error: the tool call is not valid JSON")
    assert conversations[0].messages[3]["content"] == "error: ZeroDivisionError: division by zero"
    # rl.max_turns: the last turn's call is not run
    *_, capped = _loop(family, ["call:1 + 1", "call:2 + 2"], "rl.max_turns=2")
    assert dict(capped[0].counts) == {"turns": 2, "tool_calls": 1} and capped[0].ended
    # rl.max_new_tokens bounds the whole conversation: the second turn is cut, the sample is clipped
    script = ["call:12 * 7", "It is 84.\n#### 84"]
    *_, whole = _loop(family, script)
    before_second = len(whole[0].tokens) - len(_runs(whole[0].tokens, whole[0].sampled)[-1])
    *_, engine, cut = _loop(family, script, max_new_tokens=before_second + 3)
    assert len(cut[0].tokens) == before_second + 3 and not cut[0].ended and engine.calls[1][2] == 3
    # no room left for an answer after the tool's result: the conversation ends there, clipped
    *_, full = _loop(family, script, max_new_tokens=before_second)
    assert not full[0].ended and full[0].counts["tool_calls"] == 1 and full[0].messages[-1]["role"] == "tool"


def test_a_rows_tools_must_be_ones_the_job_defines(tmp_path):
    tokenizer = qwen25_tokenizer()
    cfg = load_config(None, ["rl.tools=[calculator]"]).rl
    tools = load_tools(["calculator"])
    rows = [{"prompt": "What is 2 + 2?"}, {"prompt": "And 3 + 3?", "tools": ["calculator"]},
            {"prompt": "Weather?", "tools": ["get_weather"]}]
    with pytest.raises(ValueError, match=r"p.jsonl line 3: 'tools' names 'get_weather', which rl.tools does not"):
        encode_prompts(rows, ["line 1", "line 2", "line 3"], "p.jsonl", cfg, tokenizer, tools)
    encoded = encode_prompts(rows[:2], None, "p.jsonl", cfg, tokenizer, tools)
    assert encoded.tools == [[tools["calculator"].schema]] * 2 and encoded.templated  # strings as user turns
    assert "calculator" in tokenizer.decode(encoded.ids[0])


class CountingEpisode:
    """An environment with state, through the loop's door (issue 50): it opens with text, its one tool counts
    the calls of its own episode, it scores the episode by that count, says how many it had, and records that
    it was closed."""

    closed: list = []

    def __init__(self, row):
        self.row, self.calls = row, 0

    def start(self, row):
        return f" You have {row['budget']} tries."

    def tools(self):
        from syncwise.rl.env.tools import Tool

        def calculator(expression: str) -> str:
            self.calls += 1
            return f"try {self.calls}: {expression}"

        return {"calculator": Tool("calculator", calculator, {})}

    def reward(self):
        return float(self.calls)

    def metrics(self):
        return {"calls": float(self.calls)}

    def close(self):
        CountingEpisode.closed.append(self)


def test_an_environment_opens_the_episode_holds_its_state_and_scores_it():
    from syncwise.rl.env.scoring import RewardFunction, score_samples
    from syncwise.rl.rollout.turns import opened

    tokenizer, end, call = FAMILIES["qwen2.5"]
    tokenizer = tokenizer()
    cfg = load_config(None, ["rl.tools=[calculator]"]).rl
    schemas = [load_tools(["calculator"])["calculator"].schema]
    row = {"prompt": PROMPT, "answer": "89", "budget": 3}
    prompt_ids = encode_prompt(PROMPT, cfg, tokenizer, schemas)
    engine = ScriptedEngine(tokenizer, [call("1 + 1"), call("2 + 2"), "Done.\n#### 4"], end)
    CountingEpisode.closed = []
    loop = TurnLoop(cfg, tokenizer, None, CountingEpisode, ["calculator"])
    trajectories, _, episodes = loop.run(engine, [row], [prompt_ids], [schemas], 2, 600, seeds=[0] * cfg.max_turns)
    # what start said is appended to the last user message (as TRL does with reset's text; issue 80: apart from it
    # by a blank line where neither has whitespace at the seam): each episode's prompt is its own, so the first
    # turn is asked per conversation
    with_opening = encode_prompt(opened(PROMPT, " You have 3 tries."), cfg, tokenizer, schemas)
    assert opened(PROMPT, "Go!")[-1]["content"] == PROMPT[-1]["content"] + "\n\nGo!" and with_opening != prompt_ids
    assert opened(PROMPT, " You have 3 tries.")[-1]["content"] == PROMPT[-1]["content"] + " You have 3 tries."
    assert engine.calls[0] == ([with_opening, with_opening], 1, 600)
    for t in trajectories:
        assert t.prompt == with_opening and t.opening == " You have 3 tries."
        assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["try 1: 1 + 1", "try 2: 2 + 2"]
        assert t.env_reward == 2.0  # each episode counted its own calls
    assert not CountingEpisode.closed  # open until the trainer has scored them

    def calls_made(prompt, response, row, env):  # a reward function that reads its sample's episode
        return 0.5 * env.calls

    functions = [RewardFunction("final_number", "rl.reward_fn", final_number),
                 RewardFunction("calls_made", "rl.reward_fn", calls_made)]
    totals, parts = score_samples(functions, [row], [t.messages for t in trajectories], 2, episodes,
                                  [t.env_reward for t in trajectories], "CountingEpisode")
    assert parts["CountingEpisode"] == [2.0, 2.0] and parts["calls_made"] == [1.0, 1.0]
    assert totals == [3.0, 3.0]  # #### 4 is not 89: 0, + 1 from the reward function, + the episode's 2


# Environment classes written to TRL's environment_factory contract, the way issue 62's review found them failing.
TRL_ENVS = '''
import asyncio
import sqlite3
import threading
import time

MEETING = threading.Barrier(2, timeout=30)  # two episodes' calls that must run at the same time
RELEASE = threading.Event()  # a blocked call (in C: a lock's wait) goes on once set


class Walker:
    def reset(self, **row) -> None:
        self.at = 0

    def move(self, by: int) -> str:
        """Move along.

        Args:
            by: How far.
        """
        here = self.at
        time.sleep(0.01)  # I/O between the read and the write
        self.at = here + by
        return f"at {self.at}"

    def meet(self) -> str:
        """Wait for another episode's call to meet this one.
        """
        MEETING.wait()
        return "met"


class Ledger:
    def reset(self, **row) -> None:
        self.db = sqlite3.connect(":memory:")  # bound to the thread that opened it
        self.db.execute("create table t (x integer)")

    def put(self, x: int) -> str:
        """Store a number.

        Args:
            x: The number.
        """
        self.db.execute("insert into t values (?)", (x,))
        return str(self.db.execute("select sum(x) from t").fetchone()[0])

    def get_reward(self) -> float:
        return float(self.db.execute("select count(*) from t").fetchone()[0])


class Remote:
    async def reset(self, **row) -> str:
        await asyncio.sleep(0)
        self.seen = []
        return " Connected."

    async def look(self, where: str) -> str:
        """Look somewhere.

        Args:
            where: The place.
        """
        await asyncio.sleep(0.001)
        self.seen.append(where)
        return f"{where}: nothing"

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(len(self.seen))


class Door:
    def reset(self, **row) -> None:
        self.opened = []

    def close(self, door: str) -> str:
        """Close a door.

        Args:
            door: Which.
        """
        return f"closed {door}"

    def get_metrics(self, detail: str) -> str:
        """Read the room's meters.

        Args:
            detail: Which meter.
        """
        return f"{detail}: 0"

    @staticmethod
    def helper(x: int) -> int:
        return x

    @classmethod
    def rules(cls, topic: str) -> str:
        """The rules.

        Args:
            topic: Of what.
        """
        return f"rules of {topic}"

    @property
    def metrics(self) -> dict:
        return {"doors": 2.0}


class Hangs:
    def reset(self, **row) -> None:
        pass

    def stall(self) -> str:
        """Wait (blocked in C until the test lets go).
        """
        RELEASE.wait()
        return "done"

    def get_reward(self):
        return None


class NotFinite:
    def reset(self, **row) -> None:
        pass

    def poke(self) -> str:
        """Poke.
        """
        return "ok"

    def get_reward(self) -> float:
        return float("nan")
'''


@pytest.fixture()
def trl_envs(tmp_path):
    path = tmp_path / "trl_envs.py"
    path.write_text(TRL_ENVS)
    from syncwise.rl.env.classes import EnvironmentClass

    specs = {name: EnvironmentClass(f"{path}:{name}") for name in ("Walker", "Ledger", "Remote", "Door", "Hangs",
                                                                   "NotFinite")}
    yield specs
    specs["Hangs"].cls.stall.__globals__["RELEASE"].set()  # no blocked call outlives its test


def _episode(spec, **row):
    from syncwise.rl.env.classes import ClassEpisode

    episode = ClassEpisode(spec)
    return episode, episode.start(row)


@pytest.mark.parametrize("workers", [8, 1])
def test_one_episodes_calls_run_in_order_and_episodes_side_by_side(trl_envs, workers):
    """Issue 62 (3): three move() calls of one turn (read, 10 ms of I/O, write) ended at 100, not 111, with the
    default rl.tool_workers: TRL runs a turn's calls in order. Two episodes' calls still run at once (each waits
    to meet the other: run one after the other, both would break the barrier)."""
    first, _ = _episode(trl_envs["Walker"])
    second, _ = _episode(trl_envs["Walker"])
    calls = [(first.tools(), "move", {"by": by}) for by in (1, 10, 100)]
    calls += [(second.tools(), "move", {"by": by}) for by in (5, 50)]
    answers = ToolRunner(ToolLimits(timeout_s=30, workers=workers)).run(calls)
    assert [a.content for a in answers] == ["at 1", "at 11", "at 111", "at 5", "at 55"]
    if workers > 1:
        met = ToolRunner(ToolLimits(timeout_s=60, workers=workers)).run([(first.tools(), "meet", {}),
                                                                         (second.tools(), "meet", {})])
        assert [a.content for a in met] == ["met", "met"]
    for episode in (first, second):
        episode.close()


@pytest.mark.parametrize("workers", [8, 1])
def test_what_reset_opens_works_in_the_tools_and_the_reward(trl_envs, workers):
    """Issue 62 (4): a sqlite connection opened in reset failed on every query ("SQLite objects created in a thread
    can only be used in that same thread"), exit 0, reward 0. The episode's reset, tools and reward share a thread."""
    episode, _ = _episode(trl_envs["Ledger"])
    runner = ToolRunner(ToolLimits(timeout_s=30, workers=workers))
    answers = runner.run([(episode.tools(), "put", {"x": x}) for x in (2, 3)])
    answers += runner.run([(episode.tools(), "put", {"x": 4})])  # the next turn
    assert [(a.content, a.error) for a in answers] == [("2", None), ("5", None), ("9", None)]
    assert episode.reward() == 3.0
    episode.close()


def test_async_tools_reset_and_reward_are_awaited(trl_envs):
    """Issue 62 (5): an async tool's answer was '<coroutine object ...>' (counted non_text, 'never awaited'
    warnings) and an async get_reward crashed the rank. Awaited on the episode's own event loop."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        episode, opening = _episode(trl_envs["Remote"])
        answers = ToolRunner(ToolLimits(timeout_s=30)).run([(episode.tools(), "look", {"where": w})
                                                            for w in ("left", "right")])
        reward = episode.reward()
        episode.close()
    assert opening == " Connected."
    assert [(a.content, a.error) for a in answers] == [("left: nothing", None), ("right: nothing", None)]
    assert reward == 2.0
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_a_method_named_close_or_get_metrics_is_a_tool_as_in_trl(trl_envs):
    """Issue 62 (6): a tool named close was hidden from the model, then called with no arguments after scoring.
    TRL's contract: every public method but reset and get_reward is a tool (a class method too, a static method
    not); syncwise's own clean-up is the context manager's exit, its metrics a ``metrics`` property."""
    from syncwise.rl.env.classes import tool_methods

    door = trl_envs["Door"]
    assert sorted(door.schemas) == ["close", "get_metrics", "rules"] == tool_methods(door.cls)
    episode, _ = _episode(door)
    answers = ToolRunner(ToolLimits(timeout_s=30)).run([(episode.tools(), "close", {"door": "front"}),
                                                        (episode.tools(), "rules", {"topic": "doors"})])
    assert [a.content for a in answers] == ["closed front", "rules of doors"]
    assert episode.metrics() == {"doors": 2.0} and episode.reward() is None
    episode.close()  # calls no tool: no TypeError about a missing 'door'


def test_a_tool_that_keeps_hanging_is_called_no_more_and_threads_stay_bounded(trl_envs, runner_tools):
    """Issue 62 (7): a tool blocked past rl.tool_timeout_s left its thread, ~5.5 per rank per step, until
    'can't start new thread' escaped the runner. Now a tool with ``workers`` calls still hanging is not called
    again (counted as hung) until they end; an episode stuck in a call answers its later calls at once; a thread
    that cannot be started is the call's answer."""
    tools, _ = runner_tools
    runner = ToolRunner(ToolLimits(timeout_s=0.2, workers=3))
    before = threading.active_count()
    errors = []
    for _ in range(6):  # six turns, a call each, a turn apart by more than a call's time (a cancel's grace)
        errors.append(runner.run([(tools, "stall", {})])[0].error)
        time.sleep(0.3)
    assert errors == ["timeout"] * 3 + ["hung"] * 3, errors
    assert threading.active_count() - before == 3  # the three calls still blocked (rl.tool_workers), no more
    episode, _ = _episode(trl_envs["Hangs"])
    first, second = runner.run([(episode.tools(), "stall", {}), (episode.tools(), "stall", {})])
    assert (first.error, second.error) == ("timeout", "timeout")  # the second queued behind it, never run late
    time.sleep(0.3)
    third = runner.run([(episode.tools(), "stall", {})])[0]
    assert third.error == "hung" and "this episode's earlier call of stall still hangs" in third.content
    assert episode.reward() is None  # its state is mid-call: not asked
    tools["stall"].fn.__globals__["release"].set()  # the blocked calls return; their threads end
    deadline = time.monotonic() + 30
    while threading.active_count() > before + 1 and time.monotonic() < deadline:  # + the episode's own
        time.sleep(0.01)
    assert runner.run([(tools, "stall", {})])[0].error is None  # no longer hanging: called again
    episode.close()


def test_a_thread_that_cannot_start_is_the_calls_answer(runner_tools, monkeypatch):
    tools, _ = runner_tools

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    result = ToolRunner(ToolLimits(timeout_s=5)).run([(tools, "answer", {"kind": "none"})])[0]
    assert (result.error, result.content) == ("exception", "error: answer could not be started: can't start new thread")


def test_get_reward_none_is_no_reward_and_a_non_finite_one_is_named(trl_envs):
    """Issue 62 (8): None (TRL's 'no reward') crashed with an unnamed TypeError; NaN was reported as
    'batch['advantages']: 7 non-finite value(s)'."""
    from syncwise.rl.env.scoring import score_samples

    hangs, _ = _episode(trl_envs["Hangs"])
    assert hangs.reward() is None
    totals, parts = score_samples([], [{"prompt": "p"}], ["r", "s"], 2, None, [None, 1.5], "Hangs")
    assert totals == [0.0, 1.5] and parts["Hangs"] == [0.0, 1.5]  # nothing added for the episode without one
    nan, _ = _episode(trl_envs["NotFinite"])
    with pytest.raises(ValueError) as info:
        nan.reward()
    assert str(info.value) == ("rl.environment: NotFinite.get_reward() returned nan; a reward must be a finite number "
                               "(None for no reward)")
    for episode in (hangs, nan):
        episode.close()


def test_calls_side_by_side_print_whole_lines_each_with_its_tool(runner_tools, monkeypatch):
    """Issue 62 (11): a tool's prints from calls side by side merged onto one line despite the prefix."""
    import io
    import sys

    tools, _ = runner_tools
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    ToolRunner(ToolLimits(timeout_s=30, workers=2)).run([(tools, "halves", {"who": "a"}),
                                                          (tools, "halves", {"who": "b"})])
    assert sorted(out.getvalue().splitlines()) == [
        "[tool halves] a unfinished", "[tool halves] a: first half, second half",
        "[tool halves] b unfinished", "[tool halves] b: first half, second half"]
