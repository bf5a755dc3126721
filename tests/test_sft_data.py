"""SFT data (issue 29): every format's tokens and loss mask against a hand-tokenised reference (a chat of
three assistant turns with a system prompt, a template with and without generation markers), the errors a
user gets for bad rows (one line naming the file and the JSONL line), truncation and its counts, and the
per-epoch sample order a resumed run continues."""

from __future__ import annotations

import json

import pytest
import torch

from syncwise.data.chat import RowError, assistant_mask_source, tokenize_row, truncated
from syncwise.data.sft_dataset import (
    DatasetError,
    SampleOrder,
    load_sft_data,
    padded_batch,
    rank_share,
    read_rows,
    split_off,
)
from syncwise.sft.tasks import CHATML_TEMPLATE, arith_chat_rows, chat_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tom has 3 apples and buys 4. How many?"},
    {"role": "assistant", "content": "3 + 4 = 7.\n#### 7"},
    {"role": "user", "content": "And if he eats 2?"},
    {"role": "assistant", "content": "7 - 2 = 5.\n#### 5"},
    {"role": "user", "content": "Double it."},
    {"role": "assistant", "content": "5 * 2 = 10.\n#### 10"},
]
# The same ChatML template without {% generation %} markers: assistant turns found by prefix rendering.
PLAIN_TEMPLATE = CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(arith_chat_rows(300, seed=1))


@pytest.fixture
def plain_tokenizer(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = PLAIN_TEMPLATE
    return plain


def _piece(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _hand_tokenised(tok, messages, trailing_newline_trained: bool) -> tuple[list[int], list[int]]:
    """ChatML by hand, one piece at a time: '<|im_start|>role\\n' content '<|im_end|>' '\\n'; an assistant
    turn's content and its '<|im_end|>' are trained (and, found by prefixes, the newline after it)."""
    ids, mask = [], []
    for m in messages:
        head = _piece(tok, f"<|im_start|>{m['role']}\n")
        body = _piece(tok, m["content"]) + _piece(tok, "<|im_end|>")
        tail = _piece(tok, "\n")
        trained = m["role"] == "assistant"
        ids += head + body + tail
        mask += [0] * len(head) + [int(trained)] * len(body) + [int(trained and trailing_newline_trained)] * len(tail)
    return ids, mask


def test_messages_with_generation_markers_equal_the_hand_tokenised_reference(tokenizer):
    assert assistant_mask_source(tokenizer) == "markers"
    ids, mask = tokenize_row({"messages": CHAT}, "messages", tokenizer, "markers")
    assert (ids, mask) == _hand_tokenised(tokenizer, CHAT, trailing_newline_trained=False)
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "3 + 4 = 7.\n#### 7<|im_end|>7 - 2 = 5.\n#### 5<|im_end|>5 * 2 = 10.\n#### 10<|im_end|>"


def test_messages_without_markers_by_prefix_rendering_equal_the_reference(plain_tokenizer):
    assert assistant_mask_source(plain_tokenizer) == "prefix"
    ids, mask = tokenize_row({"messages": CHAT}, "messages", plain_tokenizer, "prefix")
    assert (ids, mask) == _hand_tokenised(plain_tokenizer, CHAT, trailing_newline_trained=False)


def test_prompt_completion_strings_and_text(tokenizer):
    ids, mask = tokenize_row({"prompt": "Q: 2 + 2?", "completion": " A: 4"}, "prompt_completion", tokenizer)
    head, tail = _piece(tokenizer, "Q: 2 + 2?"), _piece(tokenizer, " A: 4") + [tokenizer.eos_token_id]
    assert ids == head + tail and mask == [0] * len(head) + [1] * len(tail)
    ids, mask = tokenize_row({"text": "Tom has 3 apples."}, "text", tokenizer)
    assert ids == _piece(tokenizer, "Tom has 3 apples.") + [tokenizer.eos_token_id] and all(mask)


def test_conversational_prompt_completion(tokenizer):
    row = {"prompt": CHAT[:2], "completion": [CHAT[2]]}
    ids, mask = tokenize_row(row, "conversational_prompt_completion", tokenizer)
    want_ids, _ = _hand_tokenised(tokenizer, CHAT[:3], trailing_newline_trained=True)
    prompt_len = len(_hand_tokenised(tokenizer, CHAT[:2], False)[0]) + len(_piece(tokenizer, "<|im_start|>assistant\n"))
    separator = len(_piece(tokenizer, "\n"))  # after the last <|im_end|>: the template's, not trained
    assert ids == want_ids and mask == [0] * prompt_len + [1] * (len(ids) - prompt_len - separator) + [0] * separator


@pytest.mark.parametrize(("row", "fmt", "message"), [
    ({"messages": CHAT[:2]}, "messages", "no assistant turn"),
    ({"messages": [{"role": "user"}]}, "messages", r"'messages'\[0\] is not a"),
    ({"messages": []}, "messages", "an empty list"),
    ({"text": ""}, "text", "'text' is empty"),
    ({"text": 7}, "text", "'text' is int, not a string"),
    ({"prompt": "q", "completion": None}, "prompt_completion", "'completion' is NoneType"),
])
def test_bad_rows_say_why(tokenizer, row, fmt, message):
    with pytest.raises(RowError, match=message):
        tokenize_row(row, fmt, tokenizer, "markers")


def test_a_tokenizer_without_a_chat_template_is_named(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(RowError, match="has no chat template"):
        assistant_mask_source(bare)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_dataset_errors_name_the_file_and_the_jsonl_line(tmp_path, tokenizer):
    good = {"messages": CHAT[:3]}
    path = _write(tmp_path / "chat.jsonl", [good, "", good, {"messages": CHAT[:2]}, good])  # line 4: no answer
    with pytest.raises(DatasetError, match=r"^sft.dataset: .*chat.jsonl line 4: 'messages' has no assistant turn"):
        load_sft_data(path, tokenizer, 512, "right", "error")
    data = load_sft_data(path, tokenizer, 512, "right", "skip")
    assert len(data) == 3 and data.skipped == 1 and "1 bad row(s) skipped" in data.describe()
    broken = _write(tmp_path / "broken.jsonl", [good, "{not json", good])
    with pytest.raises(DatasetError, match=r"broken.jsonl: line 2 is not JSON"):
        load_sft_data(broken, tokenizer, 512, "right", "error")
    with pytest.raises(DatasetError, match=r"sft.eval_dataset: .*missing.jsonl does not exist"):
        load_sft_data(str(tmp_path / "missing.jsonl"), tokenizer, 512, "right", "error", "sft.eval_dataset")
    odd = _write(tmp_path / "odd.jsonl", [{"question": "x"}])
    with pytest.raises(DatasetError, match=r"columns \['question'\] match no SFT format"):
        load_sft_data(odd, tokenizer, 512, "right", "error")


def test_parquet_and_save_to_disk_read_alike(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": f"Q{i}:", "completion": f" A{i}"} for i in range(5)]
    jsonl = load_sft_data(_write(tmp_path / "pc.jsonl", rows), tokenizer, 512, "right", "error")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pc.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "pc_disk"))
    for other in (str(tmp_path / "pc.parquet"), str(tmp_path / "pc_disk")):
        data = load_sft_data(other, tokenizer, 512, "right", "error")
        assert data.format == "prompt_completion"
        assert (data.input_ids, data.loss_masks) == (jsonl.input_ids, jsonl.loss_masks)
    assert len(read_rows(str(tmp_path / "pc_disk"), "sft.dataset")) == 5


def test_truncation_right_left_drop_and_their_counts(tmp_path, tokenizer):
    rows = [{"prompt": "a b c d e f g h", "completion": " one two three four"}, {"prompt": "q", "completion": " a"}]
    path = _write(tmp_path / "long.jsonl", rows)
    full = load_sft_data(path, tokenizer, 512, "right", "error")
    limit = full.lengths[0] - 3
    right = load_sft_data(path, tokenizer, limit, "right", "error")
    assert right.input_ids[0] == full.input_ids[0][:limit] and right.truncated == [True, False]
    left = load_sft_data(path, tokenizer, limit, "left", "error")
    assert left.input_ids[0] == full.input_ids[0][-limit:] and left.loss_masks[0][0] == 0
    dropped = load_sft_data(path, tokenizer, limit, "drop", "error")
    assert len(dropped) == 1 and dropped.dropped == 1 and "1 too long dropped" in dropped.describe()
    cut = truncated([1, 2, 3, 4], [0, 0, 1, 1], 2, "right")  # truncation cut every target
    assert cut.dropped and cut.truncated


def test_sample_order_epochs_steps_and_positions():
    order = SampleOrder([5, 6, 7, 8, 9], seed=3)
    first = [order.index(p) for p in range(5)]
    second = [order.index(p) for p in range(5, 10)]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second  # a new order each epoch
    assert [SampleOrder([5, 6, 7, 8, 9], seed=3).index(p) for p in range(10)] == first + second  # deterministic
    samples, nxt = order.step(3, batch_size=4, batch_tokens=0, min_samples=2)
    assert nxt == 7 and samples == [order.index(p) for p in range(3, 7)]  # across the epoch boundary
    samples, nxt = order.step(0, batch_size=4, batch_tokens=20, min_samples=2)
    assert sum(order.lengths[i] for i in samples[:-1]) < 20 <= sum(order.lengths[i] for i in samples)
    assert order.steps_for(2.0, 4, 0, 2) == 3 and order.steps_for(0.5, 4, 0, 2) == 1


def test_rank_share_splits_a_step_by_length_and_covers_it():
    lengths = [10, 200, 30, 40, 50, 60]
    shares = [rank_share([0, 1, 2, 3, 4, 5], lengths, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(6))
    tokens = [sum(lengths[i] for i in s) for s in shares]
    assert max(tokens) <= 200 and min(tokens) >= 190  # the long sample alone against the rest


def test_padded_batch_and_held_out_split(tokenizer, tmp_path):
    rows = [{"messages": CHAT[:3]}] * 4 + [{"messages": CHAT}] * 4
    data = load_sft_data(_write(tmp_path / "c.jsonl", rows), tokenizer, 512, "right", "error")
    batch = padded_batch(data, [0, 7], tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, data.lengths[7]) and int(batch["attention_mask"][0].sum()) == data.lengths[0]
    assert torch.equal(batch["loss_mask"][1], torch.tensor(data.loss_masks[7]))
    train, held = split_off(data, 0.25, seed=0)
    assert len(train) == 6 and len(held) == 2
    assert sorted(train.input_ids + held.input_ids) == sorted(data.input_ids)


def test_tool_call_chats_train_the_call_with_the_rows_tools(tmp_path):
    """Issue 38 (1): a Qwen2.5 tool-use row from a save_pretrained directory reaches the template as given --
    the assistant's tool_calls, the tool message's name, the row's tools (a list, or as a JSON string) in the
    system prompt -- and the tool-call turn is trained, not an empty assistant turn."""
    from transformers import AutoTokenizer

    from user_models import TOOL_CHAT, WEATHER_TOOL, save_model_dir

    tokenizer = AutoTokenizer.from_pretrained(save_model_dir(tmp_path, "qwen2"), local_files_only=True)
    rows = [{"messages": TOOL_CHAT, "tools": [WEATHER_TOOL]},
            {"messages": TOOL_CHAT, "tools": json.dumps([WEATHER_TOOL])}]
    data = load_sft_data(_write(tmp_path / "tools.jsonl", rows), tokenizer, 1024, "right", "error")
    assert data.input_ids[0] == data.input_ids[1] and data.loss_masks[0] == data.loss_masks[1]
    ids, mask = data.input_ids[0], data.loss_masks[0]
    assert ids == tokenizer.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL], tokenize=True, return_dict=True)[
        "input_ids"]
    assert '"name": "get_weather", "description"' in tokenizer.decode(ids)  # the schema, in the system prompt
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
                       "It is 22 degrees in Paris.<|im_end|>")
    with pytest.raises(DatasetError, match=r"line 1: 'tools' is a string but not JSON"):
        load_sft_data(_write(tmp_path / "bad.jsonl", [{"messages": TOOL_CHAT, "tools": "{nope"}]), tokenizer, 1024,
                      "right", "error")
    no_content = [TOOL_CHAT[0], {"role": "assistant", "content": None, "tool_calls": TOOL_CHAT[1]["tool_calls"]}]
    ids, mask = tokenize_row({"messages": no_content, "tools": [WEATHER_TOOL]}, "messages", tokenizer, "prefix")
    assert tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m]).startswith("<tool_call>")


@pytest.mark.parametrize("template", ["markers", "prefix"])
def test_both_mask_sources_train_the_same_tokens(tokenizer, plain_tokenizer, template):
    """Issue 38 (11): found by rendering prefixes, a turn is trained through its end-of-turn token and not the
    template's newline after it -- the tokens the {% generation %} markers give for the same chat."""
    tok = tokenizer if template == "markers" else plain_tokenizer
    ids, mask = tokenize_row({"messages": CHAT}, "messages", tok, template)
    assert (ids, mask) == _hand_tokenised(tok, CHAT, trailing_newline_trained=False)
