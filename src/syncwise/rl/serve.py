"""``syncwise serve model.path=...``: the agents' endpoint (:mod:`syncwise.rl.rollout.endpoint`) on a model folder --
an export of a job, or any ``save_pretrained`` folder -- for evaluating it with the same agent code that trained it.
One process, the rollout engine ``rl.rollout_engine`` names (the compact sampler by default; vLLM on a GPU), at
``rl.temperature`` / ``rl.top_p``, answers at most ``rl.max_new_tokens`` tokens (256 where unset); each request its
own conversation (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``). Requests that arrive together are
sampled together. The key is ``SYNCWISE_API_KEY`` where set, else a fresh one, printed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config
from ..memory.accounting import resolve_budget
from .env.tasks import end_token_ids, load_tokenizer
from .rollout.base import RolloutEngine, RolloutSetup, sample_seed
from .rollout.endpoint import Endpoint
from .rollout.front import make_rollout_engine, model_name
from .rollout.serving import TurnServer
from .rollout.sessions import Session

SERVE_MAX_NEW_TOKENS = 256


@dataclass
class Served:
    """A model folder loaded to answer requests: its rollout engine and what a session needs beside it."""

    engine: RolloutEngine
    tokenizer: Any
    end_ids: list[int]
    max_new_tokens: int
    max_positions: int
    tool_parser: str

    def session(self) -> Session:
        return Session(self.tokenizer, self.end_ids, self.max_new_tokens, self.max_positions, self.tool_parser)


def load_served(config: Config) -> Served:
    """``model.path`` loaded into the rollout engine ``rl.rollout_engine`` names."""
    from transformers import AutoModelForCausalLM

    folder = config.model.path  # a folder: the command line checked it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(config)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    end_ids = sorted(set(end_token_ids(folder)) | {tokenizer.eos_token_id})
    max_new_tokens = config.rl.max_new_tokens or SERVE_MAX_NEW_TOKENS
    engine = make_rollout_engine(RolloutSetup(model.config, device, config.rl, tokenizer, end_ids, max_new_tokens,
                                              config.train.seed, resolve_budget(config.sync.memory_budget, device, 1)))
    engine.refresh(iter([{name: p.detach() for name, p in model.named_parameters()}]))  # tied: once
    max_positions = getattr(model.config, "max_position_embeddings", None) or 2**31
    return Served(engine, tokenizer, end_ids, max_new_tokens, max_positions, config.rl.tool_parser)


def serve(config: Config, host: str = "127.0.0.1", port: int = 8000, ready: Any = print) -> None:
    """Serve until interrupted (Ctrl-C: a KeyboardInterrupt, the endpoint closed first); ``ready`` is told the
    line that says where."""
    served = load_served(config)
    endpoint = Endpoint(model_name(config), stateless=True, key=os.environ.get("SYNCWISE_API_KEY") or None)
    endpoint.start(host, port)
    server = TurnServer(endpoint, served.engine, served.tokenizer,
                        {"temperature": config.rl.temperature, "top_p": config.rl.top_p})
    ready(f"syncwise serve: {model_name(config)} at {endpoint.base_url()} (api_key {endpoint.key}), "
          f"{served.engine.describe()}, up to {served.max_new_tokens} new tokens an answer; Ctrl-C stops")
    try:
        calls = 0
        while True:
            batch = server.collect(lambda: 1 << 30, first_wait_s=0.5)
            if batch:
                first = sample_seed(config.train.seed, 0, 0, 1, calls, 1 << 40, len(batch))
                server.answer(batch, lambda _: served.session(), 0, lambda k, _session, _turn, first=first: first + k)
                calls += 1
    finally:
        endpoint.close()
