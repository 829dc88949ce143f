"""Offload and onload when the rollout engine and the trainer share each GPU (colocated), taking turns with
torch_memory_saver. The colocated loop driver (:mod:`milehpc.runtime.loop.colocated`) calls the two halves of a step.

The order is Miles' (radixark/miles ``train.py``, default ``colocate_memory_peak_device``)::

    generate → offload rollout → train → offload train → onload rollout weights → update weights → onload KV cache

* **rollout side** (SGLang, started with ``enable_memory_saver=True``): ``release_memory_occupation(tags=
  ["cuda_graph", "kv_cache", "weights"])`` after generation, ``resume_memory_occupation(["weights"])`` before
  the update and ``resume_memory_occupation(["kv_cache", "cuda_graph"])`` after it (tags from
  sgl-project/sglang ``python/sglang/srt/constants.py``). The weights are released *without* a CPU copy: the update
  overwrites them anyway.
* **trainer side**: the trainer's parameters, gradients and optimizer state are allocated inside
  ``torch_memory_saver.region("train", enable_cpu_backup=True)`` and paused/resumed by tag. The contract, read in
  torch_memory_saver 0.0.10 (fzyzcjy/torch_memory_saver, checked by tests/test_tms_contract.py against the
  installed package):

  - ``hook_mode`` is write-only and only takes effect before the first ``region``/``pause``/``resume``/``disable``
    (``entrypoint.py`` ``TorchMemorySaver.hook_mode`` setter and ``_ensure_initialized``: the first call builds the
    implementation and deletes the settings; a later write raises AttributeError). Its default is ``"preload"``,
    which asserts at that first call that ``LD_PRELOAD`` names the preload library (``hooks/mode_preload.py``);
    milehpc's trainer process is not preloaded, so it sets ``"torch"`` (a ``CUDAPluggableAllocator`` on a
    ``MemPool`` per tag, ``hooks/mode_torch.py``) *before* anything else touches the saver, and refuses a saver
    already built in another mode. SGLang preloads its own scheduler processes (``configure_subprocess``).
  - the native side is fatal on misuse (``csrc/core.cpp`` ``TorchMemorySaver::pause``/``resume``: ``exit(1)``):
    pausing a tag that is already paused, or resuming one that is not paused, ends the process; allocating into
    a paused tag leaves it half paused, so its next resume ends the process. :class:`ColocatedStep` keeps track
    (one pause per resume, no ``train_region`` while paused) so those calls never reach the library.
  - ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` makes the first call raise (``entrypoint.py``
    ``_sanity_checks``).
* **start-up**: the engine is released right after it is created, before the trainer is built and warmed up
  (slime's ``create_rollout_manager`` offloads the engines at once), and the first update onloads it as every later
  one does: the start-up peak is each side alone, which is what :mod:`milehpc.memory` checks.
* **the update** reads the trainer's weights from a pinned CPU snapshot taken at the end of training
  (:class:`milehpc.weights.inplace.HostSnapshot`), uploads them *outside* any paused region and hands them to the
  engine (``update_weights_from_tensor``: CUDA IPC handles, no copy through NCCL), so the trainer can be paused
  before the rollout weights come back (the peak never holds both models' optimizer-sized state). Every rank's
  engine takes the whole model: a trainer that exports a part per rank (Megatron: each stage on its leader) has
  the parts broadcast to every rank first (:func:`milehpc.weights.inplace.whole_model`).
* **communicators**: NCCL communicators allocate their buffers outside PyTorch's allocator, so pausing a region
  does not free them. The colocated loop suspends every NCCL communicator with the trainer's memory and resumes
  them before training (:class:`milehpc.comm.nccl_memory.CommunicatorMemory`: ``ncclCommSuspend``, NCCL >= 2.29.7;
  older stacks keep the buffers, with one warning) and restores them at the end (:meth:`ColocatedStep.finish`).
  :class:`ReloadableGroups` is the other way, slime's ``reloadable_process_group``: destroy the groups and rebuild
  them (same ranks, same order) when training resumes, for code that reads its groups from it.

:class:`ColocatedStep` runs the sequence against any object with the memory-saver interface; the real one is
:func:`torch_memory_saver_backend`. The tests drive the real package with only its native binding replaced by a
recording fake derived from the installed binary (tests/tms_real.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from milehpc.errors import RuntimeFailure, missing_dependency
from milehpc.rollout.sglang_mapping import OFFLOAD_TAGS, ONLOAD_AFTER_UPDATE, ONLOAD_BEFORE_UPDATE
from milehpc.weights.inplace import HostSnapshot

if TYPE_CHECKING:
    from milehpc.weights.converters import NamedTensors

TRAIN_TAG = "train"
T = TypeVar("T")
log = logging.getLogger("milehpc.runtime.offload")


class MemorySaver(Protocol):
    """The part of ``torch_memory_saver.torch_memory_saver`` milehpc uses."""

    def region(self, tag: str = ..., enable_cpu_backup: bool = ...) -> contextlib.AbstractContextManager[Any]: ...

    def pause(self, tag: str | None = None) -> None: ...

    def resume(self, tag: str | None = None) -> None: ...


def torch_memory_saver_backend(hook_mode: str = "torch") -> MemorySaver:
    """The real memory saver (GPU only) in ``hook_mode``; one clear line when the package is missing.

    The mode must be chosen before the saver's first use (see the module docstring): a saver that something else in
    this process already built is accepted only in the same mode."""
    import importlib.util

    if importlib.util.find_spec("torch_memory_saver") is None:
        raise missing_dependency("resources.colocate = true", "torch-memory-saver")
    if importlib.util.find_spec("megatron.core") is not None:
        # megatron-core 0.16.1 sets ``torch_memory_saver.hook_mode`` when imported (inference/contexts/
        # dynamic_context.py); after the saver's first region that setter raises, so a Megatron trainer built
        # inside the region would fail at its import: import it before the saver is used.
        import megatron.core  # noqa: F401
    from torch_memory_saver import torch_memory_saver

    impl = getattr(torch_memory_saver, "_impl", None)
    if impl is None:
        torch_memory_saver.hook_mode = hook_mode
        return torch_memory_saver
    # Built already: the setter would raise AttributeError, and silently keeping another mode hides a preload
    # saver whose LD_PRELOAD the trainer process does not have.
    have = getattr(impl, "_hook_mode", None)
    if have != hook_mode:
        raise RuntimeFailure(f"torch_memory_saver was already initialised in this process with hook_mode={have!r}; "
                             f"milehpc needs hook_mode={hook_mode!r} set before its first region/pause/resume")
    return torch_memory_saver


def saver_initialised() -> bool:
    """Whether this process has used torch_memory_saver (its first region/pause/resume builds ``_impl``)."""
    import sys

    saver = getattr(sys.modules.get("torch_memory_saver"), "torch_memory_saver", None)
    return getattr(saver, "_impl", None) is not None


def end_process(code: int) -> None:
    """End a process that used torch_memory_saver without the interpreter's teardown. In torch hook mode the
    region's ``MemPool`` hands its segments back through ``tms_torch_free`` when it is destroyed at exit, outside any
    region, where 0.0.10's ``SIMPLE_CHECK(is_interesting_region)`` ends the process with status 1 (csrc/entrypoint.cpp;
    seen on an H200 after a run that had succeeded): a finished job would read as failed. The atexit handlers run
    first (logging, flushes); the GPU memory goes back to the driver with the process."""
    import atexit
    import os
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def gpu_used_bytes() -> int:
    """Device memory in use (all processes) on the current GPU: what a release frees for the other side."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


class GroupMemory(Protocol):
    """Communicator memory freed while the trainer is paused: :class:`ReloadableGroups` or
    :class:`milehpc.comm.nccl_memory.CommunicatorMemory`."""

    def release(self) -> None: ...

    def restore(self) -> None: ...


class ReloadableGroups:
    """Trainer process groups that are destroyed while the trainer is paused and rebuilt on resume.

    ``factories`` maps a name to a zero-argument callable that (collectively, on every member) creates the group;
    the current groups are in :attr:`groups`. Code that held an old group object must read it from here again.
    """

    def __init__(self, factories: dict[str, Callable[[], Any]] | None = None) -> None:
        self.factories = dict(factories or {})
        self.groups: dict[str, Any] = {}
        self.restore()

    def release(self) -> None:
        import torch.distributed as dist

        for name in list(self.groups):
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.groups.pop(name))

    def restore(self) -> None:
        for name, make in self.factories.items():
            if name not in self.groups:
                self.groups[name] = make()


@dataclass
class StepReport:
    """What one colocated step measured."""

    events: list[str] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    freed_rollout_bytes: int = 0
    freed_train_bytes: int = 0
    update_bytes: int = 0
    engine_deaths: int = 0  # engine deaths noticed this step (each is followed by one restart in place)

    @property
    def update_gbps(self) -> float:
        t = self.times.get("update_weights", 0.0)
        return self.update_bytes / t / 1e9 if t > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        out = {f"time/colocate_{k}": v for k, v in self.times.items()}
        out.update({"colocate/freed_rollout_gb": self.freed_rollout_bytes / 1e9,
                    "colocate/freed_train_gb": self.freed_train_bytes / 1e9,
                    "colocate/update_gb": self.update_bytes / 1e9, "colocate/update_gbps": self.update_gbps,
                    "colocate/engine_deaths": float(self.engine_deaths)})
        return out


def for_job(job: Any, engine: Any, *, device: Any = None, rank: int | None = None,
            share: Callable[[NamedTensors], NamedTensors] | None = None) -> ColocatedStep | None:
    """The colocated driver for a job whose engine offloads (SGLang), else None (the CPU reference engine shares
    nothing worth offloading). Release the engine (:meth:`ColocatedStep.offload_rollout`) and build the trainer
    inside ``step.train_region()``; per step the loop then calls :meth:`ColocatedStep.generate_phase` and
    :meth:`ColocatedStep.train_phase`. ``rank``: this MPI rank, for the log line of an engine death; ``share``: what
    turns this rank's export into the whole model (:func:`milehpc.weights.inplace.whole_model`)."""
    if not (job.resources.colocate and job.rollout.engine == "sglang"):
        return None
    from milehpc.comm.nccl_memory import CommunicatorMemory

    # the trainer's NCCL buffers live outside the paused region: suspended with it where NCCL allows (>= 2.29.7)
    return ColocatedStep(engine, None, torch_memory_saver_backend(), device=device, rank=rank, share=share,
                         groups=CommunicatorMemory())


class ColocatedStep:
    """Drive one engine and one trainer sharing a GPU through a step in Miles' order.

    ``engine`` implements :class:`milehpc.rollout.engine.Engine` (``release_memory``, ``resume_memory(tags)``,
    ``update_weights``); ``trainer`` implements :class:`milehpc.train.base.Trainer` and must have been *built*
    inside :meth:`train_region` so its parameters live in the pausable region. ``share`` maps this rank's export
    to the whole model when the trainer exports a part per rank (Megatron); every rank's engine loads all of it.
    """

    def __init__(self, engine: Any, trainer: Any, saver: MemorySaver, *, device: Any = None,
                 groups: GroupMemory | None = None, memory_probe: Callable[[], int] = gpu_used_bytes,
                 clock: Callable[[], float] = time.perf_counter, rank: int | None = None,
                 share: Callable[[NamedTensors], NamedTensors] | None = None) -> None:
        self.engine, self.trainer, self.saver = engine, trainer, saver
        self.rank, self.share = rank, share
        self.device, self.groups = device, groups
        self.memory_probe, self.clock = memory_probe, clock
        self.train_paused = False
        # The engine's memory tags released and not resumed yet: resuming a tag that is not released kills SGLang's
        # scheduler, so only these are resumed (an engine started or restarted in place holds everything).
        self.released: set[str] = set()
        self._death_noted = False  # a death logged and counted, its restart still to come
        self._snapshot = HostSnapshot()
        self.report = StepReport()

    # ---- the pieces, each recorded ----------------------------------------------------------------
    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        self.report.events.append(name)
        t0 = self.clock()
        try:
            return fn()
        finally:
            self.report.times[name] = self.report.times.get(name, 0.0) + self.clock() - t0

    @contextlib.contextmanager
    def train_region(self) -> Iterator[None]:
        """Allocate trainer state (model, optimizer moments, grads) inside this (CPU backup on pause)."""
        if self.train_paused:  # the native side would end the process at the next resume (module docstring)
            raise RuntimeFailure(f"torch_memory_saver region {TRAIN_TAG!r} entered while the trainer's memory is "
                                 "paused: onload_train() first")
        with self.saver.region(TRAIN_TAG, enable_cpu_backup=True):
            yield

    def _note_death(self, when: str, why: str | None = None) -> None:
        """One log line (rank, engine, what died) and one count per engine death, where it is first noticed; the
        restart that follows does not count it again."""
        if self._death_noted:
            return
        self._death_noted = True
        self.report.engine_deaths += 1
        reason = why or getattr(self.engine, "dead_reason", None) or "its health check failed"
        log.warning("milehpc: rank %s: rollout engine %s died %s (%s); restarting it in place", self.rank,
                    getattr(self.engine, "engine_index", 0), when, reason)  # not info(): a dead engine's call

    def _restart_engine(self, when: str, why: str | None = None) -> None:
        """A dead engine (its scheduler process died) restarts in place, resident, with the checkpoint's (or random)
        weights; only while the trainer is paused (a death at :meth:`offload_rollout` waits for the onload)."""
        self._note_death(when, why)
        self.engine.restart()  # raises once rollout.options.max_restarts is used up
        self._death_noted = False
        self.released = set()

    def _engine_died(self, err: RuntimeFailure, when: str) -> None:
        """Re-raise ``err`` unless the engine died during the call; then restart it."""
        if self.engine.health():
            raise err
        self._restart_engine(when, str(err))

    def offload_rollout(self) -> None:
        before = self.memory_probe()

        def run() -> None:
            # Dead: its memory went with its processes; restarted at onload_weights (the trainer is not paused yet).
            if not self.engine.health():
                self._note_death("after generating, before releasing its memory")
                return
            try:
                self.engine.release_memory()
            except RuntimeFailure as err:
                if self.engine.health():
                    raise
                self._note_death("while releasing its memory", str(err))

        self._timed("offload_rollout", run)
        self.released = set(OFFLOAD_TAGS)  # (a dead engine's memory went with it; its restart is resident)
        self.report.freed_rollout_bytes = max(0, before - self.memory_probe())

    def onload_train(self) -> None:
        if self.train_paused:
            self._timed("onload_train", lambda: self.saver.resume(TRAIN_TAG))
            if self.groups is not None:
                self.groups.restore()
            self.train_paused = False

    def finish(self) -> None:
        """End of the run: the communicators back, so that the teardown destroys live NCCL communicators rather than
        suspended ones (a path no GPU has run yet: the H200 image's torch 2.11 has no ``suspend``). The trainer's
        memory stays paused; it goes with the process."""
        if self.groups is not None:
            self.groups.restore()

    def snapshot(self) -> None:
        """Pinned host copy of the trainer's (engine-named) weights, the whole model on every rank, reused across
        steps. A rank left with nothing to load is an error, not an engine that keeps its old weights."""
        named = self.trainer.export_weights()
        self._snapshot.take(self.share(named) if self.share is not None else named)
        if not self._snapshot.buffers:
            raise RuntimeFailure(f"rank {self.rank}: the trainer exported no weights for its colocated engine")

    def offload_train(self) -> None:
        if self.train_paused:  # a second pause of the same tag ends the process (csrc/core.cpp)
            return
        before = self.memory_probe()

        def run() -> None:
            import torch

            if self.groups is not None:
                self.groups.release()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                # the default pool's cached blocks (export temporaries) go back to the device; the saver's own
                # pool (torch hook mode: one MemPool per tag) is paused as a whole below
                torch.cuda.empty_cache()
            self.saver.pause(TRAIN_TAG)

        self._timed("offload_train", run)
        self.train_paused = True
        self.report.freed_train_bytes = max(0, before - self.memory_probe())

    def _onload(self, tags: tuple[str, ...]) -> bool:
        """Resume ``tags``; True when the engine had died and was restarted instead (its weights need a refill)."""
        if not self.released.intersection(tags):
            return False  # never released, or restarted: resident already
        if not self.engine.health():
            self._restart_engine(f"before resuming {','.join(tags)}")
            return True
        try:
            self.engine.resume_memory(list(tags))
        except RuntimeFailure as err:
            self._engine_died(err, f"while resuming {','.join(tags)}")
            return True
        self.released.difference_update(tags)
        return False

    def onload_weights(self) -> None:
        self._timed("onload_weights", lambda: self._onload(ONLOAD_BEFORE_UPDATE))

    def update_weights(self, version: int) -> None:
        """The engine takes the snapshot (uploaded tensor by tensor, :class:`~milehpc.weights.inplace.HostSnapshot`)."""

        def run() -> None:
            import torch

            try:
                self.engine.update_weights(self._snapshot.upload(self.device), version)
            except RuntimeFailure as err:  # the engine died during the update: again, into the restarted one
                self._engine_died(err, "during a weight update")
                self.engine.update_weights(self._snapshot.upload(self.device), version)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # the upload buffers: give them back before the KV cache returns

        self._timed("update_weights", run)
        self.report.update_bytes = self._snapshot.uploaded_bytes

    def onload_kv(self) -> None:
        # Died after its update: refill the restarted engine, timed as an update (not inside onload_kv as well: the
        # step's phase times add up to the step's time).
        if self._timed("onload_kv", lambda: self._onload(ONLOAD_AFTER_UPDATE)):
            self.update_weights(self.trainer.version)

    # ---- the two halves of a step, and the whole step ----------------------------------------------------
    def generate_phase(self, produce: Callable[[], T]) -> T:
        """First half: a dead engine is restarted in place and re-synced to the trainer's current weights (the
        last snapshot), then ``produce()`` generates, then the rollout side is offloaded."""
        self.report = StepReport()
        if not self.engine.health():
            self._restart_engine("before generating")
            self.update_weights(self.trainer.version)
        out = self._timed("generate", produce)
        self.offload_rollout()
        return out

    def train_phase(self, train: Callable[[], dict[str, float]],
                    resident: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
        """Second half: onload train → ``train()`` inside the pausable region → snapshot → ``resident(metrics)``
        → offload train → onload weights → update weights (to the trainer's new version) → onload KV cache.
        ``resident`` runs while the trainer's memory is on the device, outside the pausable region: the checkpoint
        reads the trainer's tensors (Miles/slime save after training, before offloading). Returns ``train()``'s
        metrics with the update time (``time/sync``) and the step's memory figures."""
        self.onload_train()

        def run() -> dict[str, float]:
            with self.train_region():  # optimizer state is created lazily at the first step: keep it pausable
                metrics = train()
            self.snapshot()
            return metrics

        metrics = dict(self._timed("train", run))
        if resident is not None:
            resident(metrics)
        self.offload_train()
        self.onload_weights()
        self.update_weights(self.trainer.version)
        self.onload_kv()
        metrics["time/sync"] = self.report.times.get("update_weights", 0.0)
        metrics.update(self.report.metrics())
        return metrics

    def step(self, prompts: list[list[int]], sampling: Any, step: int, *,
             score: Callable[[list[Any]], None] | None = None) -> tuple[list[Any], dict[str, float]]:
        """generate → offload rollout → (score) → train → offload train → onload weights → update weights → onload
        KV cache: :meth:`generate_phase` then :meth:`train_phase` (the RL loop calls the halves itself)."""
        samples = self.generate_phase(lambda: self.engine.generate(prompts, sampling))
        if score is not None:
            score(samples)
        metrics = self.train_phase(lambda: self.trainer.train_step(samples, step))
        return samples, metrics

    def initial_sync(self, version: int = 0) -> None:
        """Before the first generation (Miles: "always update weight first"): push the trainer's initial weights:
        snapshot, offload train, then the rollout side's weights back, the update and its KV cache back (slime's
        train.py: onload_weights, update_weights, onload_kv). With an engine that was never released the two onloads
        do nothing."""
        self.snapshot()
        self.offload_train()
        self.onload_weights()
        self.update_weights(version)
        self.onload_kv()
