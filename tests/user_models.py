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

# Llama-3.1-Instruct's chat template, its custom-tool path (tools in the first user message, a call as a bare
# JSON object with "parameters", results as the ipython role; one call per turn)
LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools is not none %}"
    "{%- if messages | length != 0 %}{%- set first_user_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{{- raise_exception('Cannot put tools in the first user message when there is none!') }}{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call ' }}"
    "{{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}{{- 'Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>'}}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls|length == 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]


def llama31_tokenizer():
    """The built-in BPE with Llama-3.1's template and special tokens (``<|eot_id|>`` ends a turn)."""
    from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer

    tokenizer = chat_tokenizer(arith_chat_rows(300, seed=1))
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA31_SPECIALS, "bos_token": "<|begin_of_text|>",
                                  "eos_token": "<|eot_id|>"})
    tokenizer.chat_template = LLAMA31_TEMPLATE
    return tokenizer


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


def qwen25_tokenizer(special_tags: bool = False):
    """The built-in ChatML tokenizer with Qwen2.5's template and its tool-call tags as added tokens (as
    Qwen2.5's tokenizer has them: not special; ``special_tags``: special, as some Hermes-style tokenizers)."""
    from tokenizers import AddedToken

    from syncwise.sft.tasks import arith_chat_rows, chat_tokenizer

    tokenizer = chat_tokenizer(arith_chat_rows(300, seed=1))
    tags = [AddedToken(t, special=special_tags, normalized=False)
            for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")]
    if special_tags:
        tokenizer.add_special_tokens({"additional_special_tokens": tags})
    else:
        tokenizer.add_tokens(tags)
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


def save_model_dir(root: str | Path, arch: str, tokenizer=None, **sizes) -> Path:
    """``root/arch``: a ``save_pretrained`` model with its tokenizer (default: the built-in ChatML one; Qwen2.5's
    template for ``qwen2``). ``arch``: ``gpt2`` (dropout 0.1 kept in its config), ``llama`` (untied), ``qwen2``
    (tied, q/k/v biases), ``gemma2`` (tied to the embedding, soft-capping), ``mistral`` or ``qwen3_moe`` (8
    experts, top-2). ``sizes``: hidden,
    layers, heads, inter, positions."""
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
    elif arch == "gemma2":  # tied, its output layer the embedding's; logit soft-capping, sliding-window layers
        from transformers import Gemma2Config, Gemma2ForCausalLM

        model = Gemma2ForCausalLM(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=hidden // heads,
            max_position_embeddings=positions, sliding_window=positions // 2, **ends))
    elif arch == "mistral":  # untied, sliding-window attention in its config
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=positions,
            sliding_window=positions // 2, **ends))
    elif arch == "qwen3_moe":  # a mixture of experts: 8 fused experts a layer, 2 a token, its router's aux loss
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter // 4,
            num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=max(heads // 2, 1), head_dim=hidden // heads, max_position_embeddings=positions,
            tie_word_embeddings=False, router_aux_loss_coef=0.01, norm_topk_prob=True, **ends))
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


# A Hermes-format template as short as one can be (the tools' names in the system turn, calls as <tool_call> JSON,
# results as <tool_response>): the memorised model below learns a whole conversation in seconds
SHORT_HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def memorized_tool_model(root: str | Path, conversation: list[dict], tools: list[dict], steps: int = 120) -> Path:
    """``root/qwen2-tools``: a tiny tied Qwen2 with a Hermes-format template that has learnt one tool-use
    conversation by heart (plain torch, one process, seconds), so that sampling it calls a tool, reads the
    result and answers -- a real multi-turn rollout from a model this small. Saved with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from syncwise.sft.tasks import TOOL_TAGS, arith_chat_rows, chat_tokenizer

    rows = arith_chat_rows(100, seed=1)
    first = chat_tokenizer(rows, template=SHORT_HERMES_TEMPLATE, added=TOOL_TAGS)
    text = first.apply_chat_template(conversation, tools=tools, tokenize=False)
    tokenizer = chat_tokenizer(rows, texts=[text] * 20, template=SHORT_HERMES_TEMPLATE, added=TOOL_TAGS)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(  # head size 32: vLLM's CPU attention has no 16
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    path = Path(root) / "qwen2-tools"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # as the job loads it: beside a Qwen2 config, transformers 5 gives its Qwen2Tokenizer (digits split one by one)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True,
                                                      return_dict=True)["input_ids"]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    return path
