"""Model directories as users bring them (``save_pretrained`` output with its tokenizer and a real chat
template): GPT-2 (Conv1D, learned positions, dropout 0.1 in its config, tied), a Llama (untied) and a tied
Qwen2 with biases and a Qwen2.5-style template (a default system prompt, tools in the system prompt, tool
calls and tool responses). Tiny, built from configs, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

# Qwen2.5-Instruct's chat template (tools in the system prompt, <tool_call> JSON, tool responses as a user turn)
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The temperature in a city, in degrees Celsius.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}
TOOL_CHAT = [
    {"role": "user", "content": "How warm is it in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "22"},
    {"role": "assistant", "content": "It is 22 degrees in Paris."},
]


def qwen25_tokenizer():
    """The built-in ChatML tokenizer with Qwen2.5's template and its tool-call tags as added tokens (as
    Qwen2.5's tokenizer has them: not special)."""
    from tokenizers import AddedToken

    from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer

    tokenizer = chat_tokenizer(arith_chat_rows(300, seed=1))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


def save_model_dir(root: str | Path, arch: str, tokenizer=None, **sizes) -> Path:
    """``root/arch``: a ``save_pretrained`` model with its tokenizer (default: the built-in ChatML one; Qwen2.5's
    template for ``qwen2``). ``arch``: ``gpt2`` (dropout 0.1 kept in its config), ``llama`` (untied) or ``qwen2``
    (tied, q/k/v biases). ``sizes``: hidden, layers, heads, inter, positions."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer

    if tokenizer is None:
        tokenizer = qwen25_tokenizer() if arch == "qwen2" else chat_tokenizer(arith_chat_rows(300, seed=1))
    hidden, layers, heads = sizes.get("hidden", 64), sizes.get("layers", 2), sizes.get("heads", 4)
    inter, positions = sizes.get("inter", 4 * hidden), sizes.get("positions", 512)
    ends = {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=positions, n_embd=hidden,
                                           n_layer=layers, n_head=heads, **ends))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=positions,
            tie_word_embeddings=False, **ends))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=positions,
            tie_word_embeddings=True, **ends))
    else:
        raise ValueError(arch)
    path = Path(root) / arch
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Gemma's chat template: no system role, roles must alternate (its raise_exception refusals)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
