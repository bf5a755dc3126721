"""``syncwise serve model.path=...``: the agents' endpoint (:mod:`syncwise.rl.rollout.endpoint`) on a model folder --
an export of a job, or any ``save_pretrained`` folder -- for evaluating it with the same agent code that trained it.
One process, the rollout engine ``rl.rollout_engine`` names (the compact sampler by default; vLLM on a GPU), at
``rl.temperature`` / ``rl.top_p``, answers at most ``rl.max_new_tokens`` tokens (256 where unset); each request its
own conversation (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``). Requests that arrive together are
sampled together. The key is ``SYNCWISE_API_KEY`` where set, else a fresh one, printed."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..config import Config
from ..memory.accounting import resolve_budget
from .env.tasks import end_token_ids, load_tokenizer
from .rollout.base import RolloutSetup, sample_seed
from .rollout.endpoint import Endpoint
from .rollout.front import make_rollout_engine, model_name
from .rollout.serving import TurnServer
from .rollout.sessions import Session

SERVE_MAX_NEW_TOKENS = 256


def serve(config: Config, host: str = "127.0.0.1", port: int = 8000, ready: Any = print) -> None:
    """Serve until interrupted (Ctrl-C: a KeyboardInterrupt, the endpoint closed first); ``ready`` is told the
    line that says where."""
    from transformers import AutoModelForCausalLM

    if not config.model.path:
        raise ValueError("model.path: syncwise serve needs a model folder (a job's export, or save_pretrained's)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(config)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, local_files_only=True, dtype=torch.float32)
    end_ids = sorted(set(end_token_ids(config.model.path)) | {tokenizer.eos_token_id})
    max_new_tokens = config.rl.max_new_tokens or SERVE_MAX_NEW_TOKENS
    engine = make_rollout_engine(RolloutSetup(model.config, device, config.rl, tokenizer, end_ids, max_new_tokens,
                                              config.train.seed, resolve_budget(config.sync.memory_budget, device, 1)))
    engine.refresh(iter([{name: p.detach() for name, p in model.named_parameters()}]))  # tied: once
    max_positions = getattr(model.config, "max_position_embeddings", None) or 2**31
    del model
    endpoint = Endpoint(model_name(config), stateless=True, key=os.environ.get("SYNCWISE_API_KEY") or None)
    endpoint.start(host, port)
    server = TurnServer(endpoint, engine, tokenizer, {"temperature": config.rl.temperature, "top_p": config.rl.top_p})
    ready(f"syncwise serve: {model_name(config)} at {endpoint.base_url()} (api_key {endpoint.key}), "
          f"{engine.describe()}, up to {max_new_tokens} new tokens an answer; Ctrl-C stops")
    try:
        calls = 0
        while True:
            batch = server.collect(lambda: 1 << 30, first_wait_s=0.5)
            if batch:
                server.answer(batch, lambda _: Session(tokenizer, end_ids, max_new_tokens, max_positions,
                                                       config.rl.tool_parser), 0,
                              sample_seed(config.train.seed, 0, 0, 1, calls, 1 << 40, len(batch)))
                calls += 1
    finally:
        endpoint.close()
