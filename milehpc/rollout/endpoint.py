"""An OpenAI-compatible endpoint served by a rollout rank's engine: ``/v1/chat/completions`` and
``/v1/completions`` (non-streaming), ``/v1/models``.

* **Where**: 127.0.0.1 on a free port by default, or a Unix socket (in the private run directory); never a
  public interface. Every request needs ``Authorization: Bearer <job token>`` (:mod:`endpoint_auth`); others get 401.
* **Episodes**: ``/episodes/<id>/v1/...`` is the same API for one agent episode, recorded token-in/token-out
  (:mod:`agent_episode`). The episode's sampling is the job's (temperature, top-p, top-k: the trainer's logprobs
  are at the job's temperature); a request may only lower ``max_tokens`` and add ``stop`` strings. ``/v1/...``
  serves unrecorded requests with the request's own sampling.
* **Batching**: requests are queued and the engine runs them in one ``generate`` call per distinct sampling;
  a batch is cut when every running episode has a request waiting or ``batch_window_s`` after the first arrived.
* **When**: the engine is not thread-safe and its weights change between rollouts, so generation is served only
  while the rollout rank is inside a rollout (:meth:`Endpoint.serving`); at other times requests get 503.

The server (aiohttp) runs on its own event loop in a daemon thread; engine calls run on one worker thread so the
loop keeps answering (and agents in that loop keep running) while the engine works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from milehpc.rollout.agent_episode import ChatRenderer, Divergence, Episode
from milehpc.rollout.endpoint_auth import authorized
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.tool_calls import parser_for
from milehpc.samples import Sample, Status

T = TypeVar("T")


class RequestError(Exception):
    """A request the endpoint refuses: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code


# The most choices one request may ask for (``n``): each is a sample in the engine's next batch.
MAX_CHOICES = 64


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _error(status: int, message: str, code: str) -> Any:
    from aiohttp import web

    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


class Batcher:
    """Queue of pending generations; one engine call per distinct sampling (see the module docstring)."""

    def __init__(self, engine: Any, window_s: float) -> None:
        self.engine, self.window_s = engine, window_s
        self.pending: list[tuple[Sample, SamplingParams, asyncio.Future[Sample]]] = []
        self.expected = 0  # episodes running now: a batch is complete when each has a request waiting
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="milehpc-engine")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.calls = 0  # engine calls (batches) made
        self.working = False  # a batch is in the engine

    async def generate(self, sample: Sample, sampling: SamplingParams) -> Sample:
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        fut: asyncio.Future[Sample] = loop.create_future()
        self.pending.append((sample, sampling, fut))
        assert self._wake is not None
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            if not self.pending:
                continue
            deadline = loop.time() + self.window_s
            while len(self.pending) < self.expected and loop.time() < deadline:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), deadline - loop.time())
                wake.clear()
            batch, self.pending = self.pending, []
            self.working = True
            try:
                await self._dispatch(batch)
            finally:
                self.working = False

    async def _dispatch(self, batch: list[tuple[Sample, SamplingParams, asyncio.Future[Sample]]]) -> None:
        loop = asyncio.get_running_loop()
        groups: dict[str, list[tuple[Sample, SamplingParams, asyncio.Future[Sample]]]] = {}
        for item in batch:
            groups.setdefault(repr(item[1]), []).append(item)
        for items in groups.values():
            samples = [s for s, _, _ in items]
            try:
                out = await loop.run_in_executor(self.pool, self._call, samples, items[0][1])
            except Exception as err:  # every waiting request learns of it; the server goes on
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            for (_, _, fut), s in zip(items, out, strict=True):
                if not fut.done():
                    fut.set_result(s)

    async def idle(self) -> None:
        """Return once nothing is queued or in the engine."""
        while self.pending or self.working:
            await asyncio.sleep(0.005)

    def _call(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        self.calls += 1
        return self.engine.generate([], replace(sampling, n=1), samples=samples)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class Endpoint:
    """One rollout rank's endpoint (see the module docstring)."""

    def __init__(self, engine: Any, tokenizer: Any, *, token: str, sampling: SamplingParams,
                 parser: str = "qwen25", host: str = "127.0.0.1", port: int = 0,
                 unix_socket: str | Path | None = None, model: str = "policy", batch_window_s: float = 0.02) -> None:
        self.engine, self.tokenizer, self.token = engine, tokenizer, token
        self.sampling, self.model = sampling, model
        self.parse = parser_for(parser)
        self.host, self.port, self.unix_socket = host, port, unix_socket
        self.renderer = ChatRenderer(tokenizer) if getattr(tokenizer, "has_chat_template", False) else None
        self.batcher = Batcher(engine, batch_window_s)
        self.episodes: dict[str, Episode] = {}
        self.open = False
        self.refused = 0  # requests without the token
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        self.url = ""

    # ---- life cycle (called from the rollout thread) ----
    def start(self) -> Endpoint:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="milehpc-endpoint", daemon=True)
        self._thread.start()
        self.run(self._serve())
        return self

    @property
    def running(self) -> bool:
        """Started and not closed."""
        return self._loop is not None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the endpoint's loop and wait for its result."""
        assert self._loop is not None, "the endpoint is not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(Exception):
            self.run(self._shutdown(), timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(30)
        self._loop.close()
        self._loop = None
        self.batcher.pool.shutdown(wait=True)

    @contextlib.contextmanager
    def serving(self, sampling: SamplingParams | None = None) -> Iterator[None]:
        """Generation is served inside this block (the rollout); the engine is left alone outside it."""
        if sampling is not None:
            self.sampling = sampling
        self.open = True
        try:
            yield
        finally:
            self.open = False

    def episode_url(self, episode: str) -> str:
        """The OpenAI ``base_url`` of one episode."""
        return f"{self.url}/episodes/{episode}/v1"

    # ---- server ----
    async def _serve(self) -> None:
        from aiohttp import web

        @web.middleware
        async def auth(request: Any, handler: Any) -> Any:
            return await self._auth(request, handler)

        app = web.Application(middlewares=[auth], client_max_size=16 * 1024 * 1024)
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._completions)
            app.router.add_get(f"{prefix}/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        if self.unix_socket is not None:
            site: Any = web.UnixSite(self._runner, str(self.unix_socket))
            await site.start()
            Path(self.unix_socket).chmod(0o600)  # only the job's user may even connect
            self.url = "http://localhost"
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((self.host, self.port))
            site = web.SockSite(self._runner, sock)
            await site.start()
            self.port = sock.getsockname()[1]
            self.url = f"http://{self.host}:{self.port}"

    async def _shutdown(self) -> None:
        await self.batcher.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _auth(self, request: Any, handler: Any) -> Any:  # every route
        if not authorized(request.headers.get("Authorization"), self.token):
            self.refused += 1
            return _error(401, "missing or wrong bearer token (the job's token is in its run directory)",
                          "invalid_api_key")
        try:
            return await handler(request)
        except RequestError as err:
            return _error(err.status, str(err), err.code)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "owned_by": "milehpc"}]})

    async def _body(self, request: Any) -> dict[str, Any]:
        if not self.open:
            raise RequestError(503, "the policy is not serving now (between rollouts: weights are being updated)",
                               "not_serving")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError(400, "expected a JSON request body") from None
        if not isinstance(body, dict):
            raise RequestError(400, "expected a JSON object as the request body")
        if body.get("stream"):
            raise RequestError(400, "streaming is not supported (stream must be false)")
        return body

    def _count(self, body: dict[str, Any]) -> int:
        """``n``: how many choices; bounded, as each one is a sample of the engine's batch."""
        n = body.get("n", 1)
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise RequestError(400, f"expected n to be an integer from 1 to {MAX_CHOICES}, got {n!r}")
        return n

    def _tool_names(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list[str] | None]:
        """The request's tools (OpenAI's ``{"type": "function", "function": {"name": ...}}``) and their names."""
        tools = body.get("tools") or None
        if tools is None:
            return None, None
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise RequestError(400, "expected tools to be a list of {\"type\": \"function\", \"function\": "
                                    "{\"name\": ...}} objects")
        return tools, [t["function"]["name"] for t in tools]

    def _sampling(self, body: dict[str, Any], episode: bool) -> SamplingParams:
        sp = self.sampling
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or sp.max_new_tokens
        if not isinstance(limit, int) or limit < 1:
            raise RequestError(400, f"expected max_tokens to be a positive integer, got {limit!r}")
        if episode:  # recorded: the job's sampling, so the trainer's logprobs are of the same distribution
            return replace(sp, max_new_tokens=min(limit, sp.max_new_tokens), stop=[*sp.stop, *stop], n=1)
        temperature, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
        if temperature is not None and (not _number(temperature) or temperature < 0):
            raise RequestError(400, f"expected temperature to be a number >= 0, got {temperature!r}")
        if top_p is not None and (not _number(top_p) or not 0 < top_p <= 1):
            raise RequestError(400, f"expected top_p to be a number in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(400, f"expected seed to be an integer, got {seed!r}")
        return replace(sp, max_new_tokens=limit, stop=[*sp.stop, *stop],
                       temperature=sp.temperature if temperature is None else float(temperature),
                       top_p=sp.top_p if top_p is None else float(top_p), seed=seed, n=1)

    def _choice_logprobs(self, reply: Sample) -> dict[str, Any]:
        tok = getattr(self.tokenizer, "tok", None)
        text = (lambda i: tok.decode([i])) if tok is not None else (lambda i: self.tokenizer.decode([i]))
        return {"content": [{"token": text(i), "logprob": lp, "bytes": None, "top_logprobs": []}
                            for i, lp in zip(reply.response_ids, reply.rollout_logprobs, strict=True)]}

    def _reply_text(self, reply: Sample) -> str:
        return self.tokenizer.decode(reply.response_ids)

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "expected messages to be a non-empty list")
        if self.renderer is None:
            raise RequestError(400, "the model's tokenizer has no chat template: use /v1/completions")
        tools, names = self._tool_names(body)
        eid = request.match_info.get("episode")
        n = self._count(body)
        if eid is None:
            ids = self.renderer.start(messages, tools)
            sp = self._sampling(body, episode=False)
            replies = await asyncio.gather(*(self.batcher.generate(Sample(prompt_ids=list(ids)), sp)
                                             for _ in range(n)))
            version = self.engine.weight_version()
            choices = [self._chat_choice(i, r, names, body, version) for i, r in enumerate(replies)]
        else:
            ep = self.episodes.get(eid)
            if ep is None:
                raise RequestError(404, f"no running episode {eid!r}", "unknown_episode")
            if n != 1:
                raise RequestError(400, f"expected n = 1 in an episode, got {n}")
            if ep.busy:  # two requests at once cannot both extend one history
                ep.divergences += 1
                raise RequestError(409, f"episode {eid}: a request is already running", "diverged")
            ep.busy = True
            try:
                try:
                    ids = ep.context(messages, tools, self.renderer)
                except Divergence as err:
                    raise RequestError(409, str(err), "diverged") from None
                reply = await self.batcher.generate(Sample(prompt_ids=ids), self._sampling(body, episode=True))
                version = self.engine.weight_version()
                choice = self._chat_choice(0, reply, names, body, version)
                ep.record(reply, version, choice["message"], eos_id=int(self.tokenizer.eos_id))
                parsed = choice.pop("_parsed")
                ep.tool_calls += len(parsed.tool_calls)
                ep.malformed_tool_calls += parsed.malformed
            finally:
                ep.busy = False
            choices = [choice]
            replies = [reply]
        for c in choices:
            c.pop("_parsed", None)
        completion = sum(len(r.response_ids) for r in replies)
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model, "choices": choices,
            "usage": {"prompt_tokens": len(replies[0].prompt_ids), "completion_tokens": completion,
                      "total_tokens": len(replies[0].prompt_ids) + completion}})

    def _chat_choice(self, index: int, reply: Sample, names: list[str] | None, body: dict[str, Any],
                     version: int) -> dict[str, Any]:
        parsed = self.parse(self._reply_text(reply), names if names else None, id_prefix=f"call_{uuid.uuid4().hex[:8]}")
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if names and parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            finish = "tool_calls"
        else:
            message["content"] = self._reply_text(reply)  # no tools offered: the text as the model wrote it
            finish = "length" if reply.status is Status.TRUNCATED else "stop"
        choice = {"index": index, "message": message, "finish_reason": finish,
                  "logprobs": self._choice_logprobs(reply) if body.get("logprobs") else None,
                  # token-in/token-out for callers that want it (OpenAI clients keep unknown fields)
                  "milehpc": {"token_ids": reply.response_ids, "weight_version": version}, "_parsed": parsed}
        return choice

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request)
        if request.match_info.get("episode") is not None:
            raise RequestError(400, "episodes are recorded through /chat/completions only")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            ids = list(prompt)  # token ids, as the OpenAI API allows
        else:
            raise RequestError(400, "expected prompt to be a string or a list of token ids")
        sp = self._sampling(body, episode=False)
        n = self._count(body)
        replies = await asyncio.gather(*(self.batcher.generate(Sample(prompt_ids=list(ids)), sp) for _ in range(n)))
        version = self.engine.weight_version()
        choices = [{"index": i, "text": self._reply_text(r),
                    "finish_reason": "length" if r.status is Status.TRUNCATED else "stop",
                    "logprobs": ({"tokens": [self.tokenizer.decode([t]) for t in r.response_ids],
                                  "token_logprobs": r.rollout_logprobs} if body.get("logprobs") else None),
                    "milehpc": {"token_ids": r.response_ids, "weight_version": version}}
                   for i, r in enumerate(replies)]
        completion = sum(len(r.response_ids) for r in replies)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model, "choices": choices,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                      "total_tokens": len(ids) + completion}})
