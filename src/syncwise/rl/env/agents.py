"""``rl.agent``: the user's own agent -- ``file.py:function`` or ``package.module:function``, sync or ``async`` --
run once per sample against the rank's OpenAI-compatible endpoint. It is given, by parameter name, any of ``row``
(the dataset row), ``base_url``, ``api_key``, ``model`` and ``client`` (an ``openai.AsyncOpenAI`` made for its
session), talks to the endpoint as much as it likes (several calls, tools, calls side by side), and returns its
reward -- a number -- or ``None`` to have ``rl.reward_fn`` score the final conversation. Its parameters are
checked before any rank starts. It is your code and runs with the job's rights."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .loader import load_function
from .scoring import checked_reward

AGENT_ARGUMENTS = ("row", "base_url", "api_key", "model", "client")
# the shared pool's idle connections outlive an update (httpx's default 5 s would reconnect every step), and stay
# below the endpoint's own keep-alive (rollout.endpoint.KEEP_ALIVE_S): the pool lets a connection go first
POOL_KEEP_ALIVE_S = 600


@dataclass
class AgentFunction:
    path: str
    fn: Callable[..., Any]

    @classmethod
    def load(cls, path: str) -> AgentFunction:
        """The function ``rl.agent`` names, its parameters checked: a ValueError in one line otherwise."""
        fn = load_function(path, "rl.agent")
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError) as exc:
            raise ValueError(f"rl.agent: {path} has no signature to read") from exc
        unknown = [name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                   and name not in AGENT_ARGUMENTS and p.default is p.empty]
        if unknown:
            raise ValueError(f"rl.agent: {path} asks for {', '.join(unknown)}; an agent is given by name any of "
                             f"{', '.join(AGENT_ARGUMENTS)}")
        return cls(path, fn)

    @property
    def wants(self) -> set[str]:
        parameters = inspect.signature(self.fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            return set(AGENT_ARGUMENTS)
        return {name for name in parameters if name in AGENT_ARGUMENTS}

    def http_client(self, connections: int) -> Any:
        """What the runs' ``client``s share, where the function asks for one: one connection pool (an
        ``openai.AsyncOpenAI`` with a pool of its own takes ~25 ms to make -- 1.6 s for 64 runs a step); None
        otherwise. The caller closes it."""
        if "client" not in self.wants:
            return None
        import httpx
        import openai

        return openai.DefaultAsyncHttpxClient(limits=httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=POOL_KEEP_ALIVE_S))

    async def run(self, row: dict[str, Any], base_url: str, api_key: str, model: str,
                  http_client: Any = None) -> float | None:
        """One run: the function awaited (a sync one in a worker thread), its reward checked; ``http_client``:
        the pool its ``client`` uses (:meth:`http_client`)."""
        wants = self.wants
        given: dict[str, Any] = {"row": row, "base_url": base_url, "api_key": api_key, "model": model}
        if "client" in wants:
            import openai

            given["client"] = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                                 http_client=http_client)
        given = {k: v for k, v in given.items() if k in wants}
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(**given)
        else:
            value = await asyncio.to_thread(self.fn, **given)
        return reward_value(self.path, value)


def reward_value(path: str, value: Any) -> float | None:
    """An agent's return as its sample's reward: None (rl.reward_fn scores), or a finite number."""
    return checked_reward(value, f"rl.agent: {path} returned", "None: rl.reward_fn scores")
