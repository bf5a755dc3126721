"""An OpenAI-compatible HTTP endpoint on loopback (FastAPI on uvicorn, in a thread of its own): the door through
which agent code written against OpenAI's API -- the ``openai`` client, LangGraph, smolagents -- reaches the rank's
rollout engine.

Routes, under a session's base URL ``http://127.0.0.1:PORT/s/<session>/v1`` (:mod:`syncwise.rl.rollout.sessions`:
token in, token out), and under ``/v1`` for ``syncwise serve`` (each request its own session):

- ``POST /chat/completions`` -- ``messages``, ``tools`` / ``tool_choice`` (auto, none), ``max_tokens`` /
  ``max_completion_tokens``, ``stop``, ``logprobs``, ``return_token_ids`` (vLLM's); ``n`` 1; ``temperature``,
  ``top_p`` and ``seed`` are the job's (what it trains on: a request's own are not applied, and counted);
  ``stream`` refused in OpenAI's error shape;
- ``POST /completions`` -- a text prompt, or token ids;
- ``GET /models``.

Every request needs the job's key (``Authorization: Bearer ...``; 401 otherwise). The handlers only check and
queue a request; the rank's own thread takes the queued requests of all its sessions together and samples them
in one engine call (:class:`~syncwise.rl.rollout.serving.TurnServer`), then answers each. Errors are OpenAI's
JSON: ``{"error": {"message", "type", "param", "code"}}``."""

# No ``from __future__ import annotations`` here: FastAPI reads the route functions' annotations at run time, and
# its Request is imported where the app is made (fastapi and uvicorn are the rl.agent extra's)
import asyncio
import hmac
import json
import math
import queue
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

REQUEST_FIELDS = {"chat": "messages", "text": "prompt"}
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # every address: the URL printed names the machine instead
# How long an idle connection stays open: far beyond any client pool's own expiry (httpx 5 s, aiohttp 15 s, the
# agents' shared pool POOL_KEEP_ALIVE_S), so a pool never sends on a connection the server is closing -- with
# uvicorn's 5 s against httpx's 5 s, a step whose update took ~5 s failed some runs' first request
# (APIConnectionError: "Server disconnected"; 9 and 14 of 32 runs at 2 of 100 steps of the tools recipe)
KEEP_ALIVE_S = 3600


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Pending:
    """A queued request: its session, kind (``chat`` or ``text``), body, and where its answer goes."""

    session: str
    kind: str
    body: dict[str, Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)

    def answer(self, status: int, body: dict[str, Any]) -> None:
        """Called from the sampling thread: the HTTP handler returns ``body`` with ``status``."""
        def settle() -> None:
            if not self.future.done():
                self.future.set_result((status, body))
        self.loop.call_soon_threadsafe(settle)


class Endpoint:
    """The endpoint of one process: ``model`` the name it serves, a fresh key; ``stateless``: ``/v1`` routes, a
    session per request (``syncwise serve``)."""

    def __init__(self, model: str, stateless: bool = False, key: str | None = None):
        self.model, self.stateless = model, stateless
        self.key = key or "sk-syncwise-" + secrets.token_urlsafe(24)
        self.requests: queue.Queue[Pending] = queue.Queue()
        self.sessions: set[str] = set()
        self.refused: Counter = Counter()  # requests answered here, never queued: unauthorized, malformed
        self.host, self.port = "127.0.0.1", 0
        self._server = None
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def base_url(self, session: str | None = None) -> str:
        """Where a client reaches it: the address it listens on, this machine's name where that is every address."""
        host = socket.gethostname() if self.host in WILDCARD_HOSTS else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}" + (f"/s/{session}/v1" if session else "/v1")

    def open_session(self) -> str:
        session = secrets.token_hex(8)
        self.sessions.add(session)
        return session

    def close_session(self, session: str) -> None:
        self.sessions.discard(session)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serve from a thread of its own until :meth:`close` (loopback unless ``host`` says otherwise)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.host, self.port = host, sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        started = threading.Event()

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_until_complete(self._server.serve(sockets=[sock]))

        self._thread = threading.Thread(target=serve, name="syncwise-endpoint", daemon=True)
        self._thread.start()
        started.wait(30)
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(10)
            self._server = None

    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(title="syncwise", docs_url=None, redoc_url=None, openapi_url=None)

        async def handle(request: Request, session: str | None, kind: str) -> JSONResponse:
            status, body = await self._handle(request, session, kind)
            return JSONResponse(body, status_code=status)

        @app.post("/s/{session}/v1/chat/completions")
        async def chat(session: str, request: Request):
            return await handle(request, session, "chat")

        @app.post("/s/{session}/v1/completions")
        async def text(session: str, request: Request):
            return await handle(request, session, "text")

        @app.get("/s/{session}/v1/models")
        async def models(session: str, request: Request):
            return await handle(request, session, "models")

        if self.stateless:
            @app.post("/v1/chat/completions")
            async def chat_once(request: Request):
                return await handle(request, None, "chat")

            @app.post("/v1/completions")
            async def text_once(request: Request):
                return await handle(request, None, "text")

            @app.get("/v1/models")
            async def models_once(request: Request):
                return await handle(request, None, "models")
        return app

    async def _handle(self, request: Any, session: "str | None", kind: str) -> "tuple[int, dict[str, Any]]":
        """Checks what needs no model (the key, the session, the body's shape), then queues the request and waits
        for the sampling thread's answer."""
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                   f"Bearer {self.key}".encode()):  # in constant time: no key guessed by timing
            self.refused["unauthorized"] += 1
            return 401, error_body("Incorrect API key provided: use the key the job gave the agent (api_key).",
                                   code="invalid_api_key")
        if session is not None and session not in self.sessions:
            return 404, error_body(f"session {session} is not open (its agent run is over)", code="session_closed")
        if kind == "models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                     "owned_by": "syncwise"}]}
        try:
            body = await request.json()
        except ValueError:
            body = None
        problem = check_body(body, kind)
        if problem is not None:
            self.refused["malformed"] += 1
            return 400, error_body(*problem)
        future = asyncio.get_running_loop().create_future()
        self.requests.put(Pending(session or "", kind, body, future, asyncio.get_running_loop()))
        return await future


def check_body(body: Any, kind: str) -> tuple[str, str, str | None] | None:
    """What the handler refuses before queueing: (message, type, param), or None. Every field a client may send is
    checked for its type here, so that nothing a request holds can raise in the sampling thread (which would end
    ``syncwise serve`` or the rank): what a client may send is listed on the agents page."""
    problem = _body_problem(body, kind)
    return None if problem is None else (problem[0], "invalid_request_error", problem[1])


def _body_problem(body: Any, kind: str) -> tuple[str, str | None] | None:
    if not isinstance(body, dict):
        return "the request body must be a JSON object", None
    try:  # a lone surrogate (JSON's "\\ud800") is no text a tokenizer can read
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return "the request holds a lone UTF-16 surrogate, which is not text", None
    except (TypeError, ValueError):
        return "the request body must be plain JSON", None
    needed = REQUEST_FIELDS[kind]
    if needed not in body:
        return f"{needed}: required", needed
    if body.get("stream"):
        return "stream: streaming is not served here; send stream=false (the whole answer in one response)", "stream"
    if body.get("tool_choice") not in (None, "auto", "none"):
        return ("tool_choice: 'auto' or 'none' (the job samples freely: 'required' or a named function would need "
                "constrained sampling)", "tool_choice")
    if body.get("n", 1) != 1:
        return "n: one choice a request (a session is one conversation)", "n"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            return f"{key}: a positive integer, got {_short(value)}", key
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None and (not _is_number(value) or not math.isfinite(value) or value < 0):
            return f"{key}: a number at least 0, got {_short(value)}", key
    if body.get("seed") is not None and not _is_int(body["seed"]):
        return f"seed: an integer, got {_short(body['seed'])}", "seed"
    for key in ("logprobs", "return_token_ids"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            return f"{key}: true or false, got {_short(body[key])}", key
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return f"stop: a string or a list of strings, got {_short(stop)}", "stop"
    if kind == "chat":
        return _messages_problem(body["messages"]) or _tools_problem(body.get("tools"))
    return _prompt_problem(body["prompt"])


def _messages_problem(messages: Any) -> tuple[str, str] | None:
    if not isinstance(messages, list) or not messages:
        return "messages: a non-empty list of messages is required", "messages"
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"{where}: an object with a string role", "messages"
        content = message.get("content")
        if content is not None and not isinstance(content, str) and not (
                isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("text", ""), str)
                                                  for part in content)):
            return f"{where}.content: a string, or a list of text parts", "messages"
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                return f"{where}.{key}: a string", "messages"
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            return f"{where}.tool_calls: a list of tool calls", "messages"
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return (f"{where}.tool_calls[{j}]: an object with a function {{'name': str, 'arguments': str}}",
                        "messages")
            if not isinstance(function.get("arguments", ""), (str, dict)):
                return f"{where}.tool_calls[{j}].function.arguments: a JSON string", "messages"
    return None


def _tools_problem(tools: Any) -> tuple[str, str] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        return "tools: a list of {'type': 'function', 'function': {'name': str, ...}} schemas", "tools"
    return None


def _prompt_problem(prompt: Any) -> tuple[str, str] | None:
    """A string, token ids, or a list holding one of either (OpenAI's batch of one)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return None  # the ids' range is the tokenizer's to check (TurnServer)
    return "prompt: a non-empty string, or a list of token ids", "prompt"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
