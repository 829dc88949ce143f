"""The ``agent`` generator (``[rollout] generator = "agent"``): the user's agent code, written against the OpenAI
chat API, runs as the rollout.

``generator_params.agent = "package.module:run"`` names ``async def run(client, sample) -> result``. ``client`` is
a standard ``openai.AsyncOpenAI`` whose ``base_url`` is this rank's endpoint (:mod:`milehpc.rollout.endpoint`)
for one episode; ``sample`` is a dict ``{"prompt", "messages", "label", "metadata", "index"}``. ``result`` is the
reward (a number), a dict with ``"reward"`` (the rest goes to the sample's ``metadata["agent"]``), or None to let
the job's reward score the response text.

Up to ``max_parallel`` episodes run at once on the endpoint's event loop, each under ``episode_timeout_s``. Every
chat call of an episode is recorded token-in/token-out (:mod:`milehpc.rollout.agent_episode`): the sample is the
first prompt's tokens, then each reply (trained on) and the messages the agent added (tool results: masked from
the loss). An episode that times out, raises, or whose history diverges under ``on_divergence = "drop"`` becomes
FAILED samples (never trained on, counted in ``rollout/failed`` and the ``agent_*`` metadata).

An episode never outlives its rollout: the generator returns only when every episode has ended and the engine is
idle, so a weight update or a checkpoint never sees a half-recorded episode (none is carried across).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from milehpc.config.families import parser_name
from milehpc.errors import ConfigError
from milehpc.plugin_types import load_ref
from milehpc.rollout.agent_episode import Episode
from milehpc.rollout.endpoint import Endpoint
from milehpc.rollout.endpoint_auth import job_token
from milehpc.rollout.engine import SamplingParams
from milehpc.samples import Sample, Status
from milehpc.samples.sample import AGENT_COUNTS

# One endpoint per engine (rank), started by its first rollout. Found by the engine object itself, not by its id
# alone (an id is reused once its object is freed): the entry holds a weak reference to the engine, the endpoint only
# a proxy of it, so an engine that is freed closes its endpoint and leaves the table.
_ENDPOINTS: dict[int, tuple[Callable[[], Any], Endpoint]] = {}


def endpoint_for(engine: Any, tokenizer: Any, sampling: SamplingParams, *, run_dir: str | os.PathLike[str] | None,
                 tool_parser: str = "qwen25", unix_socket: bool = False) -> Endpoint:
    """This rank's endpoint, started on first use. Its token is the job's, in ``run_dir`` (a private temporary
    directory when the caller has none)."""
    entry = _ENDPOINTS.get(id(engine))
    if entry is not None and entry[0]() is engine and entry[1].running:
        return entry[1]
    private = Path(run_dir) if run_dir is not None else _private_temp("milehpc-endpoint-")
    sock = private / f"endpoint-{os.uname().nodename}-{os.getpid()}.sock" if unix_socket else None
    if sock is not None and len(str(sock)) > 100:  # AF_UNIX paths are limited to 108 bytes
        sock = _private_temp("milehpc-") / "endpoint.sock"
    try:
        served: Any = weakref.proxy(engine)
    except TypeError:  # an engine without weak references: held (it then lives as long as its endpoint)
        served = engine
    ep = Endpoint(served, tokenizer, token=job_token(private), sampling=sampling, parser=tool_parser,
                  unix_socket=sock).start()
    use_endpoint(engine, ep)
    atexit.register(ep.close)
    return ep


def use_endpoint(engine: Any, ep: Endpoint) -> None:
    """Serve ``engine``'s agent episodes through ``ep`` from now on (:func:`endpoint_for` does it for the endpoints
    it starts; tests hand in their own). The entry goes, and the endpoint is closed, when the engine is freed."""
    key = id(engine)
    try:
        ref: Callable[[], Any] = weakref.ref(engine, lambda _: _forget(key, ep))
    except TypeError:
        ref = lambda: engine  # noqa: E731  (held: its id cannot be reused while the entry exists)
    _ENDPOINTS[key] = (ref, ep)


def _forget(key: int, ep: Endpoint) -> None:
    """The engine behind ``ep`` was freed: drop its entry (unless another took the key) and close ``ep``."""
    if key in _ENDPOINTS and _ENDPOINTS[key][1] is ep:
        del _ENDPOINTS[key]
    if threading.current_thread().name.startswith(("milehpc-endpoint", "milehpc-engine")):
        threading.Thread(target=ep.close, daemon=True).start()  # close() joins those threads: not from them
    else:
        ep.close()


def _private_temp(prefix: str) -> Path:
    """A mode-0700 temporary directory removed at exit (after the endpoint closed: atexit runs last-in first):
    it holds the token or the socket, which must not outlive the process in /tmp."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def close_endpoints() -> None:
    """Stop this process's endpoints (tests and notebooks; a job's end with its process)."""
    while _ENDPOINTS:
        _ENDPOINTS.popitem()[1][1].close()


def _task(prompt: Any) -> dict[str, Any]:
    raw = getattr(prompt, "raw", None)
    text = raw if isinstance(raw, str) else prompt.text
    messages = [dict(m) for m in raw] if isinstance(raw, list) else [{"role": "user", "content": text}]
    return {"prompt": text, "messages": messages, "label": prompt.label,
            "metadata": dict(prompt.metadata), "index": prompt.index}


async def _episodes(ep: Endpoint, run: Any, tasks: list[dict[str, Any]], *, timeout_s: float, max_parallel: int,
                    on_divergence: str) -> list[tuple[Episode, Any, str | None]]:
    import httpx
    import openai

    transport = httpx.AsyncHTTPTransport(uds=str(ep.unix_socket)) if ep.unix_socket else None
    # trust_env=False: a site's http_proxy must not route loopback calls through a proxy
    http = httpx.AsyncClient(transport=transport, trust_env=False, timeout=httpx.Timeout(timeout_s + 5),
                             limits=httpx.Limits(max_connections=max_parallel + 4))
    gate = asyncio.Semaphore(max_parallel)

    async def one(task: dict[str, Any]) -> tuple[Episode, Any, str | None]:
        episode = Episode(uuid.uuid4().hex, on_divergence=on_divergence)
        async with gate:
            ep.episodes[episode.id] = episode
            ep.batcher.expected += 1
            client = openai.AsyncOpenAI(base_url=ep.episode_url(episode.id), api_key=ep.token, http_client=http,
                                        max_retries=0)
            try:
                return episode, await asyncio.wait_for(run(client, task), timeout_s), None
            except TimeoutError:
                return episode, None, f"timeout after {timeout_s:g} s"
            except Exception as err:  # the agent's own failure ends its episode only
                return episode, None, f"{type(err).__name__}: {err}"[:500]
            finally:
                ep.batcher.expected -= 1
                ep.episodes.pop(episode.id, None)

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await http.aclose()
        await ep.batcher.idle()  # a timed-out episode's request may still be in the engine: let it finish


def agent_generator(engine: Any, prompts: list[Any], sampling: SamplingParams, *, agent: str,
                    episode_timeout_s: float = 120.0, max_parallel: int = 64, on_divergence: str = "drop",
                    tool_parser: str | None = None, unix_socket: bool = False, run_dir: str | None = None,
                    tokenizer: Any = None, model_type: str | None = None) -> list[Sample]:
    """``sampling.n`` episodes per prompt; their samples prompt-major (a split episode gives several).
    ``tool_parser`` None: the parser of the ``model_type`` family (checked on the login node; the rollout loop
    passes it), ``qwen25`` for a caller that names neither."""
    tok = tokenizer if tokenizer is not None else engine.tokenizer
    try:
        parser = parser_name(tool_parser, model_type) if tool_parser or model_type else "qwen25"
    except ValueError as err:
        raise ConfigError(str(err), field="rollout.generator_params.tool_parser") from None
    ep = endpoint_for(engine, tok, sampling, run_dir=run_dir, tool_parser=parser, unix_socket=unix_socket)
    try:
        run = load_ref(agent)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"expected an importable 'package.module:function' on the ranks (is its folder in the "
                          f"job's env.PYTHONPATH?), got {agent!r}: {err}",
                          field="rollout.generator_params.agent") from None
    tasks = [(g, _task(p)) for g, p in enumerate(prompts) for _ in range(sampling.n)]
    with ep.serving(sampling):
        outcomes = ep.run(_episodes(ep, run, [t for _, t in tasks], timeout_s=episode_timeout_s,
                                    max_parallel=max_parallel, on_divergence=on_divergence))
    out: list[Sample] = []
    for (g, _), (episode, result, error) in zip(tasks, outcomes, strict=True):
        samples = episode.samples() or [Sample(prompt_ids=list(prompts[g].ids), status=Status.FAILED,
                                               metadata={"agent_calls": 0})]
        reward, extra = result, {}
        if isinstance(result, dict):
            extra = {k: v for k, v in result.items() if k != "reward"}
            reward = result.get("reward")
        for s in samples:
            s.group = g
            s.response_text = tok.decode(s.response_ids)
            if error is not None:
                s.status = Status.FAILED
                s.metadata["agent_error"] = error
            if s.status is Status.FAILED:
                s.reward = 0.0  # never trained on; a number keeps the reward hooks from scoring it
            elif reward is not None:
                s.reward = float(reward) if isinstance(reward, int | float) else reward
            if extra:
                s.metadata["agent"] = extra
        samples[0].metadata[AGENT_COUNTS] = {  # once per episode: rollout/agent/* metrics (summed over the step)
            "episodes": 1, "calls": episode.calls, "tool_calls": episode.tool_calls,
            "malformed_tool_calls": episode.malformed_tool_calls, "divergences": episode.divergences,
            "split": len(samples) - 1, "timeouts": int(error is not None and error.startswith("timeout")),
            "dropped": int(any(s.status is Status.FAILED for s in samples))}
        out += samples
    return out
