"""The SGLang rollout engine on the rollout ranks (implements :class:`milehpc.rollout.engine.Engine`).

Choice: **in-process ``sglang.Engine``, one per engine group, no HTTP server and no router process.**
Miles/slime launch one HTTP server per engine and route requests through sglang-router because Ray places
engines as actors anywhere; under MPI every rollout rank already *is* a long-lived process pinned to its GPU, so
the engine lives in that process: requests and token ids move as Python lists (no JSON, no detokenise /
retokenise), weight-update and memory calls are plain method calls (``Engine.init_weights_update_group``,
``update_weights_from_distributed``, ``update_weights_from_tensor``, ``release_memory_occupation``...), no port per
engine has to be reachable from other nodes, and load balancing across engines is milehpc's own
(:mod:`milehpc.rollout.router`), which the loop applies when it hands prompts to engine leaders over MPI.
SGLang's scheduler (one subprocess per GPU) and detokenizer run as children of the rank, so the engine is still
out-of-process for crash purposes: :meth:`health` watches those children and :meth:`restart` replaces them in place.

``gpus_per_engine > 1`` (tensor parallel over several MPI ranks): each rank drives one GPU, so each rank of the
engine starts ``sglang.Engine(tp_size=N, nnodes=N, node_rank=r, dist_init_addr=leader:port, base_gpu_id=g)`` and
drives its own GPU ``g`` (:func:`base_gpu_id`) as one SGLang "node"; with ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0``
the non-leader ``Engine`` returns once its scheduler is ready (python/sglang/srt/entrypoints/engine.py ``_launch_subprocesses``),
and only the leader (``node_rank == 0``, which owns the tokenizer manager) takes requests.

Weight sync (the trainer is the source):

* **separate ranks**: trainer stage leader + every SGLang TP scheduler form one NCCL group per pipeline stage,
  created SGLang's way (``Engine.init_weights_update_group``: TCP rendezvous at the stage leader, ``PrefixStore``
  named after the group; the trainer joins as rank 0 with :func:`milehpc.weights.sglang.join_update_group`).
  Per bucket, the metadata (HF names, dtype names, shapes) goes to the engine leaders over MPI first; the leaders
  call ``update_weights_from_distributed(..., load_format="flattened_bucket", flush_cache=True)`` while the trainer
  broadcasts the bucket as one flat uint8 tensor from rank 0. See :mod:`milehpc.weights.sglang`.
* **colocated**: ``update_weights_from_tensor`` per bucket (CUDA IPC handles, no copy through NCCL), driven by
  :mod:`milehpc.runtime.offload` in Miles' order.

Image prompts (a vision-language model, :class:`Vision`): each request carries its images as SGLang's
``processor_output`` item (patch rows and grids from milehpc's own pixel cache, :func:`milehpc.data.images.pixels`,
the reference engine's and the trainer's pixels) beside the ids milehpc widened to one image token per merged
patch, so SGLang runs no processor of its own. Weights go under the names SGLang's class loads
(:func:`milehpc.rollout.sglang_mapping.engine_name`); with ``model.freeze_vision`` the trainer sends the language
model alone. SGLang keeps the vision tower's outputs per image (``SGLANG_VLM_CACHE_SIZE_MB``, keyed by the pixels'
hash) across weight updates, so an engine whose vision tower is trained starts with that cache off: an image seen
before an update would otherwise keep its old features.

Generation is never interrupted by an update: ``generate`` and the update methods share one lock, so an update
waits for the running batch (the in-process ``Engine.generate`` is synchronous); :meth:`abort` (thread-safe) cuts a
running batch short for partial rollouts (SGLang ``TokenizerManager.abort_request(abort_all=True)``), the cut
samples come back ABORTED with their tokens and are continued later.

Sources checked: sgl-project/sglang ``python/sglang/srt/entrypoints/engine.py``, ``server_args.py``,
``managers/tokenizer_manager.py``, ``managers/io_struct.py``, ``sampling/sampling_params.py``, ``constants.py``;
THUDM/slime ``slime/rollout/sglang_rollout.py`` and ``slime/backends/sglang_utils/sglang_engine.py``;
radixark/miles ``train.py`` (offload order). Facts are listed in :mod:`milehpc.rollout.sglang_mapping`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.sglang_options import SGLangOptions, parse_options, rl_quantization_args
from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.faults import armed
from milehpc.rollout import sglang_cpu_memory, sglang_lora
from milehpc.rollout import sglang_mapping as sm

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import LoraSpec
    from milehpc.rollout.engine import SamplingParams
    from milehpc.samples import Sample

# SGLang's scheduler imports this module (it unpickles sigquit_handler from the server args): a CPU engine with LoRA
# has it make host-memory pinning a no-op there before the LoRA layers are built (milehpc.rollout.sglang_lora).
sglang_lora.unpin_if_asked()
# ... and it reads a CPU engine's memory budget there, before the model loads (milehpc.rollout.sglang_cpu_memory).
sglang_cpu_memory.apply_if_asked()

# On a CPU with AMX, sglang 0.5.23 packs the weights for its AMX kernels at load, after which a weight update fails
# ("'Parameter' object has no attribute 'weight_loader'"), and those kernels take bf16/fp16 only. A CPU engine has
# them off: the start-up hook scripts/setup-sglang-cpu.sh installs (scripts/sglang_cpu_hook.py) reads this in the
# scheduler, which then takes the plain-torch path of CPUs without AMX.
AMX_OFF_ENV = "MILEHPC_SGLANG_CPU_NO_AMX"

# sglang's cache of vision-tower outputs per image (srt/environ.py; srt/managers/mm_schedule.py), never cleared by a
# weight update: 0 turns it off (every image's features are computed afresh, once per batch).
VLM_CACHE_ENV = "SGLANG_VLM_CACHE_SIZE_MB"


@dataclass(frozen=True)
class Vision:
    """A vision-language engine's image side."""

    folder: str  # the processor folder its images' pixels come from (model.tokenizer)
    model_type: str  # the family (the weight names SGLang's class loads)
    frozen: bool = False  # model.freeze_vision: the vision tower is never synced


ENGINE_PORT_BASE = 30000  # + engine index * 16; never served (the Engine API is in-process) but must be free

# The settings the real sglang 0.5.23 engine runs with on a CPU (../shared/notes/sglang-on-cpu.md): no CUDA graphs or
# flashinfer, one scheduler step at a time, a small KV pool, no warm-up request. The memory fraction is of the engine's
# explicit budget (rollout.options.cpu_memory_gib; milehpc.rollout.sglang_cpu_memory), not of the host's free memory.
CPU_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu", "attention_backend": "torch_native", "disable_overlap_schedule": True,
    "mem_fraction_static": 0.5, "max_total_tokens": 4096, "chunked_prefill_size": -1, "skip_server_warmup": True,
}


def cpu_colocated_args(args: dict[str, Any], opts: SGLangOptions) -> dict[str, Any]:
    """A colocated engine on a CPU: memory saving off (torch_memory_saver needs libcuda; with it on, SGLang's
    scheduler dies at start-up, exit code 127), so release/resume_memory_occupation pause nothing (SGLang's no-op
    saver adapter) and the weights stay; and the CPU's small memory share instead of the colocated GPU default 0.5."""
    out = {**args, "enable_memory_saver": False}
    if opts.mem_fraction_static is None:
        out["mem_fraction_static"] = CPU_SERVER_ARGS["mem_fraction_static"]
    return out


def log(line: str) -> None:
    """One line on the rank's stderr (the job's output): group rebuilds and restarts are rare and worth seeing."""
    import sys

    print(f"milehpc: {line}", file=sys.stderr, flush=True)


def version_note() -> str | None:
    """One line when the installed sglang is not the one the contract tests ran against (None when it is)."""
    from milehpc.config.sglang_options import TESTED_SGLANG
    from milehpc.config.tested_versions import version_warning

    return version_warning("sglang", TESTED_SGLANG)


WATCH_S = 0.5  # how often a waiting engine call checks that the engine's children are alive


def _cancel_tasks(loop: Any) -> None:
    """On the engine's event loop: cancel what it runs, so a call waiting for a dead scheduler returns."""
    import asyncio

    for task in asyncio.all_tasks(loop):
        task.cancel()


def _alive(pid: int) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


# SGLang's children (scheduler exception handler, SubprocessWatchdog) signal a failure with SIGQUIT to this rank.
# The launch-phase handler is ``ServerArgs.custom_sigquit_handler``, which sglang deep-copies and pickles into the
# spawned scheduler: it must be a module-level function (a bound method drags the engine's RLock along and the
# engine never starts). It marks every live engine of this process dead; health() reports it, the loop restarts.
_LIVE: weakref.WeakSet[SGLangEngine] = weakref.WeakSet()


def sigquit_handler(signum: int = signal.SIGQUIT, frame: Any = None) -> None:
    """SIGQUIT from an SGLang child: mark this process's engines dead instead of killing the rank. The signal does not
    say whose child sent it: an engine is marked only while one of its own processes is gone or its engine has none
    yet. The watchdog thread of an engine that was just restarted in place may still report the child it lost (seen
    under load: the restarted engine was marked dead by its predecessor's late "scheduler crashed with exit code -9");
    a failing child that signals before it exits is found by :meth:`SGLangEngine.health` once it has."""
    for engine in list(_LIVE):
        engine.sigquits += 1
        if not engine._pids or any(not _alive(pid) for pid in engine._pids):
            engine._dead_reason = engine._dead_reason or "an SGLang subprocess signalled a failure (SIGQUIT)"


def _report_instead_of_kill(engine: Any) -> None:
    """The tokenizer manager installs its own SIGQUIT handler on the first request (``auto_create_handle_loop``:
    ``running_phase_sigquit_handler`` → ``kill_process_tree(os.getpid())``, the whole MPI rank). Give it a handler
    class whose SIGQUIT only reports; SIGTERM keeps SGLang's behaviour."""
    tm = getattr(engine, "tokenizer_manager", None)
    base = getattr(tm, "signal_handler_class", None)
    if tm is None or base is None:
        return

    class ReportingSignalHandler(base):  # type: ignore[misc, valid-type]
        def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
            watchdog = getattr(self.tokenizer_manager, "_subprocess_watchdog", None)
            if watchdog is not None:
                watchdog.stop()  # it would signal again every poll
            sigquit_handler(signum, frame)

    tm.signal_handler_class = ReportingSignalHandler


PORT_RACE = "died during initialization"  # sglang's words when a child could not bind its port (among others)
OOM_KILLED = "exit code: -9)"  # ... and when the OS killed the scheduler (SIGKILL: the OOM killer): no retry


def _launch(factory: Any, args: dict[str, Any], engine: int, before: set[int]) -> Any:
    """``factory(**args)``, once more when a child died during initialization. SGLang picks its internal ports free
    and binds them later, so another process on a busy node (another rank's engine, an MPI job) can take one in
    between (seen in CI: EADDRINUSE, then "scheduler died during initialization"); a second start picks new ports.
    The failed start's other children (detokenizer, other TP schedulers: sglang 0.5.23 cleans them up only at
    exit) are killed first and added to ``before`` (this rank's children that are not the engine's)."""
    try:
        return factory(**args)
    except RuntimeError as err:
        if PORT_RACE not in str(err) or OOM_KILLED in str(err):
            raise
        stale = _kill(_children() - before)
        before |= stale
        log(f"SGLang engine {engine} {PORT_RACE} ({str(err).splitlines()[0][:200]}); a port it picked may have "
            f"been taken meanwhile: starting it once more (stopped {len(stale)} leftover process(es) first)")
        return factory(**args)


def _kill(pids: set[int]) -> set[int]:
    """SIGKILL ``pids`` and wait (reaping this process's children) until they are gone; returns ``pids``."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
    psutil.wait_procs(procs, timeout=30)
    return pids


def model_folder(ctx: Any, vocab_size: int, pad_id: int, eos_id: int) -> tuple[str, bool]:
    """(folder SGLang loads, whether the weights are random). A random model is an HF ``config.json`` written from
    the job's ``[model]`` table and loaded with ``load_format="dummy"``: the trainer's weights arrive by the first
    weight sync before any generation (as Miles does: "always update weight first")."""
    job = ctx.job
    if job.model.path:
        if not Path(job.model.path).is_dir():
            raise ConfigError(f"expected a local HF checkpoint folder, got {job.model.path!r}", field="model.path")
        return job.model.path, False
    from milehpc.models import causal_lm_class, hf_config

    folder = Path(ctx.run_dir) / "sglang-model"
    config = hf_config(job.model, vocab_size, pad_id=pad_id, eos_id=eos_id)
    config.torch_dtype = job.model.dtype
    config.architectures = [causal_lm_class(job.model).__name__]  # SGLang picks its model class by this name
    if ctx.comms.rank == min(ctx.plan.engine_leaders() or [0]):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"config.json.{os.getpid()}"
        tmp.write_text(config.to_json_string())
        tmp.replace(folder / "config.json")  # atomic: other engines on the shared filesystem read it
    wait_s = job.resources.startup_timeout_s  # the first leader may be slow to start on a busy node
    deadline = time.monotonic() + wait_s
    while not (folder / "config.json").exists():
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"{folder}/config.json was not written by the first engine leader within "
                                 f"{wait_s:.0f} s (resources.startup_timeout_s)")
        time.sleep(0.2)
    return str(folder), True


class SGLangEngine:
    """One rank's share of an SGLang engine (:class:`milehpc.rollout.engine.DirectSyncEngine`: on separate rollout
    ranks the weight bytes go trainer → SGLang schedulers directly, see :mod:`milehpc.weights.sglang`; colocated
    engines take tensors through ``update_weights``). Only the leader (``engine_rank == 0``) generates and updates."""

    def __init__(self, job: Any, server_args: dict[str, Any], opts: SGLangOptions, *, engine: int = 0,
                 engine_rank: int = 0, eos_id: int | None = None, moe_shape: tuple[int, int] | None = None,
                 colocated: bool = False, version: int = 0, engine_factory: Any = None, gather: Any = None,
                 lora: LoraSpec | None = None, vision: Vision | None = None) -> None:
        self.job = job
        self._factory = engine_factory  # None = sglang.Engine (tests pass a stand-in: no GPU here)
        self.server_args = dict(server_args)
        self.opts = opts
        self.engine_index = engine
        self.engine_rank = engine_rank
        self.is_leader = engine_rank == 0
        self.eos_id = eos_id
        self.moe_shape = moe_shape if server_args.get("enable_return_routed_experts") else None
        self.colocated = colocated
        self.version = version
        self.restarts = 0
        self.tokens_generated = 0
        self.batches = 0  # generate calls answered (the fault point counts them)
        self.sigquits = 0  # SIGQUITs from SGLang's children reported instead of killing the rank
        self.update_groups: dict[str, dict[str, Any]] = {}  # group name -> init_weights_update_group kwargs
        self._stage_group: dict[int, str] = {}  # pipeline stage -> the name of its current update group
        self._syncing: int | None = None  # the version a sync in progress brings (fault injection counts it)
        self._sync_faults: set[int] = set()  # versions whose ``sync`` fault has fired (once: the re-send succeeds)
        self._last_names: list[str] = []
        self.unreadable: set[str] = set()  # names get_weights_by_name answered None for
        self._session_open = False
        # engine_rank > 0 of a multi-rank colocated engine: payload -> the leader (returns all, by engine rank)
        self.gather: Any = gather
        self._lock = threading.RLock()
        self._dead_reason: str | None = None
        self._engine: Any = None
        self._pids: set[int] = set()
        self.lora = lora  # [trainer.lora] (LoraSpec): syncs load adapters through SGLang's LoRA API (sglang_lora)
        # What a generate request names: adapter (None: the job's one adapter; multi-LoRA: its name) -> the name
        # SGLang loaded it under, and its last loaded tensors (peft names); none loaded: the base model.
        self.adapter_names: dict[str | None, str] = {}
        self.adapters: dict[str | None, dict[str, Any]] = {}
        self._adapter_loads = 0  # loads so far: part of each adapter's name, never reused
        self.vision = vision
        self._start()

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        factory = self._factory
        if factory is None:
            import sglang  # the plugin registry checked it is installed

            factory = sglang.Engine
            note = version_note()
            if note:
                log(note)
        if self.server_args.get("device") == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # else sglang imports vllm for its CPU ops
            require_amx_hook()
            os.environ[AMX_OFF_ENV] = "1"  # read by scripts/sglang_cpu_hook.py in the scheduler (see there)
            os.environ.update(sglang_cpu_memory.budget_env(self.opts.cpu_memory_gib))  # read by the scheduler
            if self.lora is not None:
                os.environ[sglang_lora.UNPIN_ENV] = "1"  # read by the scheduler, see sglang_lora.unpin_if_asked
        if self.server_args.get("nnodes", 1) > 1:
            os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
            if self.server_args.get("device") == "cpu" and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
                # A CPU TP rank binds its threads to "its" NUMA node unless told its cores, and every rank of a
                # multi-rank engine is TP rank 0 of its own SGLang node: all would take node 0 (and SGLang refuses
                # more TP ranks than NUMA nodes). Each rank's scheduler gets the cores this rank was given.
                os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_list(os.sched_getaffinity(0))
        # Logprobs of the temperature-scaled distribution (SGLang's default), which is what the trainer recomputes;
        # SGLANG_RETURN_ORIGINAL_LOGPROB=1 would return pre-temperature ones and break train–rollout agreement.
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
        before = _children()
        # A dying scheduler sends SIGQUIT to its parent; SGLang's default handler then kills this whole rank. (The
        # scheduler unpickles the handler, so it imports this module: that import applies unpin_if_asked there.)
        args = {**self.server_args, "custom_sigquit_handler": sigquit_handler}
        _LIVE.add(self)
        vlm_cache = os.environ.get(VLM_CACHE_ENV)
        if self.vision is not None and not self.vision.frozen:
            os.environ[VLM_CACHE_ENV] = "0"  # read by the scheduler: see VLM_CACHE_ENV
        try:
            self._engine = _launch(factory, args, self.engine_index, before)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"SGLang refused the engine arguments: {err}", field="rollout.options") from err
        finally:
            # The scheduler has read them; no later child inherits them.
            for name in (sglang_lora.UNPIN_ENV, AMX_OFF_ENV, sglang_cpu_memory.MEMORY_ENV, VLM_CACHE_ENV):
                os.environ.pop(name, None)
            if vlm_cache is not None:  # the user's own setting stays
                os.environ[VLM_CACHE_ENV] = vlm_cache
        _report_instead_of_kill(self._engine)
        self._pids = _children() - before
        self._dead_reason = None

    def health(self) -> bool:
        """False when a scheduler/detokenizer child of this rank has died (or SGLang signalled a failure)."""
        if self._engine is None or self._dead_reason:
            return False
        dead = [pid for pid in self._pids if not _alive(pid)]
        if dead:
            self._dead_reason = f"SGLang subprocess(es) {dead} exited"
            return False
        return True

    def restart(self) -> None:
        """Shut down and start again in place. Weights come back as the checkpoint's (or random); the caller must
        re-run the weight-update group setup and a full weight sync (``needs_weight_sync`` is then True).
        Only this rank's share restarts: a multi-rank engine's other ranks are not restarted (their schedulers are
        children of their own ranks), so the job ends if one of them dies."""
        if self.restarts >= self.opts.max_restarts:
            raise RuntimeFailure(
                f"SGLang engine {self.engine_index} died again after {self.restarts} restart(s) "
                f"(rollout.options.max_restarts = {self.opts.max_restarts}): {self._dead_reason}")
        with self._lock:
            self.shutdown()
            self._start()
            self.restarts += 1
            self.update_groups.clear()
            self._stage_group.clear()
            self._session_open = False
            self._syncing = None
            self.version = -1
            self.adapter_names = {}  # a new engine has no adapter loaded

    @property
    def needs_weight_sync(self) -> bool:
        return self.version < 0

    @property
    def dead_reason(self) -> str | None:
        """What died, once :meth:`health` found the engine down (None while it serves)."""
        return self._dead_reason

    def _revive_lora(self, version: int) -> None:
        """[trainer.lora] on separate rollout ranks, where no re-sync from the trainer exists (the rank itself holds
        the adapter): a dead engine restarts in place with LoRA enabled (the same server arguments); the caller
        then loads the adapter of ``version`` before any request (:mod:`milehpc.rollout.sglang_lora`)."""
        reason = self._dead_reason
        self.restart()  # counted; raises once rollout.options.max_restarts is used up
        log(f"SGLang engine {self.engine_index} died ({reason}); restarted in place with LoRA, loading adapter "
            f"version {version}")

    def _self_restarts(self) -> bool:
        """A LoRA engine on separate rollout ranks restarts itself when found dead; a colocated one is restarted by
        the colocated driver (memory resident again, :mod:`milehpc.runtime.offload`), a full-weight one through
        the trainer's re-sync (:mod:`milehpc.runtime.loop.separate_rollout`)."""
        return self.lora is not None and not self.colocated and not self.health()

    def shutdown(self) -> None:
        if self._engine is not None:
            # Our SIGQUIT handler stays installed: a child dying during teardown must not take the rank down. The
            # engine's watchdog thread goes first: it would report this engine's children to the next one.
            watchdog = getattr(getattr(self._engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
            if watchdog is not None:
                watchdog.stop()
            try:
                self._engine.shutdown()
            finally:
                self._engine = None

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Every engine call: fails with a message naming the engine instead of hanging on a dead one. The Engine's
        methods wait on its event loop for a scheduler reply that never comes once the scheduler has died (e.g. a
        weight loader's assertion), so a watcher thread cancels the loop's tasks when a child dies mid-call."""
        import asyncio

        if not self.health():
            raise RuntimeFailure(f"SGLang engine {self.engine_index} is down ({self._dead_reason}); restart it")
        done = threading.Event()
        loop = getattr(self._engine, "loop", None)

        def watch() -> None:
            while not done.wait(WATCH_S):
                if not self.health():
                    if loop is not None:
                        loop.call_soon_threadsafe(_cancel_tasks, loop)
                    return

        watcher = threading.Thread(target=watch, name=f"sglang-{self.engine_index}-watch", daemon=True)
        watcher.start()
        try:
            return fn(*args, **kwargs)
        except (Exception, asyncio.CancelledError) as err:
            if not self.health():
                raise RuntimeFailure(f"SGLang engine {self.engine_index} died during {what}: {self._dead_reason}") from err
            raise
        finally:
            done.set()

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        """``sampling.n`` samples per prompt (or the continuation of ``samples``); leader only."""
        if not self.is_leader:
            return []
        if self.eos_id is not None and self.eos_id not in sampling.stop_token_ids:
            from dataclasses import replace

            sampling = replace(sampling, stop_token_ids=[*sampling.stop_token_ids, self.eos_id])
        requests = sm.build_requests(prompts, sampling, samples,
                                     seeded=bool(self.server_args.get("enable_deterministic_inference")))
        if not requests:
            return []
        kwargs = sm.generate_kwargs(requests, return_routed_experts=self.moe_shape is not None,
                                    images=self._image_items() if self.vision is not None else None)
        with self._lock:
            for attempt in (0, 1):  # a LoRA engine that dies during the call comes back and answers it once more
                if self._self_restarts():  # died since it last served: back with its adapters, at its version
                    version, held = self.version, dict(self.adapters)
                    self._revive_lora(version)
                    if held:
                        self._load_peft(held, version)
                    else:
                        self.version = version  # no adapter synced yet: the base is the policy (peft's B = 0)
                version = self.version
                if (paths := self._lora_paths(requests, sampling)) is not None:
                    kwargs["lora_path"] = paths
                try:
                    outputs = self._call("generate", self._engine.generate, **kwargs)
                    break
                except RuntimeFailure:
                    if attempt or not self._self_restarts():
                        raise
        if isinstance(outputs, dict):
            outputs = [outputs]
        if len(outputs) != len(requests):
            raise RuntimeFailure(f"SGLang returned {len(outputs)} outputs for {len(requests)} requests")
        out = [sm.to_sample(o, r, weight_version=version, moe_shape=self.moe_shape) for o, r in zip(outputs, requests,
                                                                                                 strict=True)]
        self.tokens_generated += sum(len(s.response_ids) for s in out) - sum(len(r.prefix_ids) for r in requests)
        if armed("scheduler", self.batches):
            self.kill_scheduler()
        self.batches += 1
        return out

    def _image_items(self) -> Any:
        """A request's image references -> its ``processor_output`` item, one per distinct list of images (a
        prompt's ``n`` requests share it)."""
        from milehpc.data.images import pixels

        folder, made = self.vision.folder, {}

        def item(refs: list[str]) -> dict[str, Any]:
            key = tuple(refs)
            if key not in made:
                made[key] = sm.processor_output([pixels(folder, ref) for ref in refs])
            return made[key]
        return item

    def _engine_name(self, name: str) -> str:
        """The name SGLang's model class loads ``name`` (the trainer's) under."""
        return sm.engine_name(name, self.vision.model_type if self.vision is not None else None)

    def _lora_paths(self, requests: list[sm.Request], sampling: SamplingParams) -> list[str | None] | None:
        """Each request's ``lora_path``: the loaded name of its prompt's adapter (multi-LoRA: every adapter in the one
        batch; one not synced yet, or None, is the base), or of the job's one adapter; None without LoRA."""
        if sampling.adapters is not None:
            if any(r.source is not None for r in requests):
                raise RuntimeFailure("continuing partial rollouts per adapter is not supported")
            return [self.adapter_names.get(sampling.adapters[r.group]) for r in requests]
        path = self.adapter_names.get(None)
        return None if path is None else [path] * len(requests)

    def kill_scheduler(self) -> None:
        """Fault injection (``MILEHPC_FAULT=scheduler:N``, ``sync:V``, ``eval:STEP``): SIGKILL this engine's
        scheduler process(es)."""
        import psutil

        for pid in self._pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if "scheduler" in " ".join(proc.cmdline()) + proc.name():
                    proc.kill()
                    # A loaded machine may run the victim only later: the fault is "dead after batch N", so wait
                    # (without reaping it: SGLang's own watchdog does) until it is.
                    deadline = time.monotonic() + 30
                    while _alive(pid) and time.monotonic() < deadline:
                        time.sleep(0.05)


    def abort(self) -> None:
        """Cut the running batch short (thread-safe); its samples return ABORTED with the tokens so far."""
        engine = self._engine
        if engine is None or not self.is_leader:
            return
        tm = engine.tokenizer_manager
        engine.loop.call_soon_threadsafe(lambda: tm.abort_request(abort_all=True))

    # ---- weights ------------------------------------------------------------------------------------------------
    @property
    def selector(self) -> str:
        """Which SGLang model runners a weight update goes to. With speculative decoding the trainer's tensors are
        the target model's: ``"all"`` (SGLang's default) would also load them into the draft model."""
        return "target" if self.server_args.get("speculative_algorithm") else "all"

    def _request(self, what: str, req: str, method: str, **fields: Any) -> Any:
        """Send an SGLang ``io_struct`` request through the tokenizer manager (the ``Engine`` methods do the same
        but do not expose ``selector``) and raise one clear error unless it succeeded."""
        from sglang.srt.managers import io_struct

        engine = self._engine
        obj = getattr(io_struct, req)(**fields)
        result = self._call(what, lambda: engine.loop.run_until_complete(
            getattr(engine.tokenizer_manager, method)(obj, None)))
        _check_result(what, result)
        return result

    def _begin_session(self) -> None:
        # SGLang refuses updates outside a begin/end session (managers/scheduler_components/weight_updater.py).
        if not self._session_open:
            self._request("begin_weight_update", "BeginWeightUpdateReqInput", "begin_weight_update",
                          selector=self.selector)
            self._session_open = True

    def _end_session(self) -> None:
        if self._session_open:
            self._session_open = False
            self._request("end_weight_update", "EndWeightUpdateReqInput", "end_weight_update")

    def _abandon_session(self) -> None:
        """After a failed update: close the session so the next sync can open one (errors here are secondary)."""
        with contextlib.suppress(Exception):
            self._end_session()
        self._session_open = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Colocated path: load this rank's tensors (HF names) bucket by bucket inside one weight-update session,
        then flush once. With ``gpus_per_engine > 1`` every rank of the engine calls this with the tensors on its
        own GPU: each serializes them (CUDA-IPC handles only the scheduler on the same GPU can open) and the leader
        sends one request carrying one payload per TP rank, as slime does."""
        if self.lora is not None:
            self._load_adapter(named_tensors, version)
            return
        bucket_bytes = self.opts.weight_bucket_mb << 20
        names: list[str] = []
        tp = int(self.server_args.get("tp_size", 1))
        with self._lock:
            try:
                if self.is_leader:
                    self._begin_session()
                for bucket in sm.buckets(named_tensors, bucket_bytes):
                    payloads = self._gather_payloads([(self._engine_name(n), t) for n, t in bucket], tp)
                    if self.is_leader:
                        self._request("update_weights_from_tensor", "UpdateWeightsFromTensorReqInput",
                                      "update_weights_from_tensor", serialized_named_tensors=payloads,
                                      load_format=None, flush_cache=False, selector=self.selector)
                    names.extend(n for n, _ in bucket)
                if not self.is_leader:
                    return
                self._end_session()
            except BaseException:
                if self.is_leader:
                    self._abandon_session()
                raise
            self._call("flush_cache", self._engine.flush_cache)
            self._last_names = names
            self.version = version

    def _load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """LoRA: the synced adapter goes to SGLang's LoRA API under the version's own name; the previous one is
        unloaded once the new one loaded (:mod:`milehpc.rollout.sglang_lora`). Leader only: SGLang sends each TP
        scheduler its copy."""
        if not self.is_leader:
            return
        adapters = {a: sglang_lora.adapter_tensors(part, self.lora)
                    for a, part in sglang_lora.split_adapters(named_tensors).items()}
        with self._lock:
            if self._self_restarts():  # died since it last served: restarted before the new adapter loads
                self._revive_lora(version)
            self._load_peft(adapters, version)

    def _load_peft(self, adapters: dict[str | None, dict[str, torch.Tensor]], version: int) -> None:
        """Load each adapter's tensors (peft names) as weight version ``version``; the ones they replace are unloaded
        once all loaded. A failed load leaves the engine serving the previous ones alone: the new ones loaded before
        it are unloaded again."""
        with self._lock:
            loaded: dict[str | None, str] = {}
            try:
                for adapter, tensors in adapters.items():
                    config = sglang_lora.config_dict(tensors, self.lora)
                    self._adapter_loads += 1  # a version sent again (a re-sync) loads under a new name too
                    name = sglang_lora.adapter_name(version, self._adapter_loads, adapter)
                    result = self._call("load_lora_adapter_from_tensors", self._engine.load_lora_adapter_from_tensors,
                                        name, tensors, config)
                    _check_result("load_lora_adapter_from_tensors", (result.success, result.error_message))
                    loaded[adapter] = name
            except RuntimeFailure:
                if self.health():  # (a dead engine forgets them all: its restart loads what the rank holds)
                    for name in loaded.values():
                        self._unload_adapter(name)
                raise
            old = [self.adapter_names[a] for a in loaded if a in self.adapter_names]
            self.adapter_names.update(loaded)
            self.adapters.update(adapters)
            for name in old:
                self._unload_adapter(name)
            self.version = version

    def _unload_adapter(self, name: str) -> None:
        result = self._call("unload_lora_adapter", self._engine.unload_lora_adapter, name)
        _check_result("unload_lora_adapter", (result.success, result.error_message))

    def _gather_payloads(self, bucket: list[tuple[str, torch.Tensor]], tp: int) -> list[Any]:
        """One serialized payload per TP rank, in TP-rank order (``deserialize_own_rank`` picks index tp_rank)."""
        from sglang.srt.utils import MultiprocessingSerializer

        if any(t.is_cuda for _, t in bucket):
            import torch

            # The scheduler reads these through CUDA IPC on its own stream: our copies must be done.
            torch.cuda.current_stream().synchronize()
        mine = MultiprocessingSerializer.serialize(bucket, output_str=True)
        if tp == 1:
            return [mine]
        if self.gather is None:
            raise RuntimeFailure(f"SGLang engine {self.engine_index} spans {tp} ranks but has no way to gather "
                                 "their weight payloads (gather=None)")
        got = self.gather(mine)
        return route_payloads(got, tp) if self.is_leader else []

    def join_update_group(self, *, master_address: str, master_port: int, world_size: int, stage: int,
                          backend: str = "nccl", group_name: str | None = None) -> None:
        """Separate-ranks path: this engine's TP schedulers join the stage's update group ``group_name`` (default:
        the stage's first name), leaving the stage's previous group first (leader only)."""
        if not self.is_leader:
            return
        name = group_name or sm.group_name(stage)
        kwargs = {"master_address": master_address, "master_port": int(master_port),
                  "rank_offset": sm.rank_offset(self.engine_index, self.server_args.get("tp_size", 1)),
                  "world_size": int(world_size), "group_name": name, "backend": backend}
        with self._lock:
            old = self._stage_group.pop(stage, None)
            if old is not None and self.update_groups.pop(old, None) is not None:
                # Rebuilt after an engine restarted or a sync broke. A group whose broadcast failed may refuse a
                # clean destroy (SGLang answers failure then): the name is dropped either way, the new group has
                # its own name and port.
                result = self._call("destroy_weights_update_group", self._engine.destroy_weights_update_group,
                                    group_name=old)
                if not (isinstance(result, tuple) and result and result[0]):
                    log(f"SGLang engine {self.engine_index}: leaving update group {old}: {result}")
            result = self._call("init_weights_update_group", self._engine.init_weights_update_group, **kwargs)
        _check_result("init_weights_update_group", result)
        self.update_groups[name] = kwargs
        self._stage_group[stage] = name
        log(f"SGLang engine {self.engine_index} joined weight-update group {name} (stage {stage}, rank "
             f"{kwargs['rank_offset']} of {world_size})")

    def receive_bucket(self, meta: dict[str, list], *, stage: int) -> None:
        """Separate-ranks path: receive one bucket the trainer broadcasts as one flat uint8 tensor (``meta`` =
        names/dtypes/shapes in the buffer's order), inside the sync's weight-update session (opened at the first
        bucket, closed by :meth:`finish_update`)."""
        if not self.is_leader:
            return
        with self._lock:
            try:
                self._begin_session()
                if self._syncing is not None and armed("sync", self._syncing) and self._syncing not in self._sync_faults:
                    self._sync_faults.add(self._syncing)  # MILEHPC_FAULT=sync:V: the scheduler dies while the
                    self.kill_scheduler()  # trainer's broadcast of version V's first bucket is under way
                # One flat uint8 broadcast per bucket (sm.flatten_bucket). flush_cache=True flushes the radix cache
                # inside the request, after the load. On a GPU torch_empty_cache returns the received buffer to the
                # device (what the separate flush_cache call did); on the CPU that clean-up is a full gc.collect()
                # in the scheduler, most of a sync's time, so it is left out there.
                self._request("update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput",
                              "update_weights_from_distributed", names=[self._engine_name(n) for n in meta["names"]],
                              dtypes=meta["dtypes"], shapes=meta["shapes"],
                              group_name=self._stage_group.get(stage, sm.group_name(stage)),
                              load_format=sm.FLATTENED_BUCKET, flush_cache=True,
                              torch_empty_cache=self.server_args.get("device") != "cpu", selector=self.selector)
            except BaseException:
                self._abandon_session()
                raise
        self._last_names.extend(meta["names"])

    def finish_update(self, version: int) -> None:
        """After the last bucket of every stage: close the session (each bucket flushed the radix cache), take the
        version."""
        self._syncing = None  # the sync is over either way
        if not self.is_leader:
            return
        with self._lock:
            try:
                self._end_session()
            except BaseException:
                self._abandon_session()
                raise
            self.version = version

    def load_weights_from_disk(self, path: str, version: int) -> None:
        """Reload every weight from an HF checkpoint folder (``Engine.update_weights_from_disk``), result checked."""
        if not self.is_leader:
            return
        with self._lock:
            result = self._call("update_weights_from_disk", self._engine.update_weights_from_disk, path)
            _check_result("update_weights_from_disk", result)
            self.version = version

    def begin_update(self, version: int | None = None) -> None:
        """A weight sync (of ``version``, when known) starts."""
        self._last_names = []
        self._syncing = version

    def weight_version(self) -> int:
        return self.version

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor | None]]:
        """The last synced weights, read back from the engine: the first ``check_weights_truncate`` elements of each
        (``Engine.get_weights_by_name(name, truncate_size)``); compare against the trainer's flattened prefix.
        A name the engine cannot read back comes with None (a weight check fails on it: unreadable is unverified).
        With LoRA: the adapter as handed to ``load_lora_adapter_from_tensors`` and its scaling, in the sync's names
        (SGLang 0.5.23 cannot read a loaded adapter back; the logprob check after each sync is the evidence that it
        serves it)."""
        import torch

        if not self.is_leader:
            return
        if self.lora is not None:
            from milehpc.rollout.reference import LORA_SCALING

            scaling = torch.tensor([self.lora.alpha / self.lora.rank], dtype=torch.float64)
            for adapter in self.adapters or {None: {}}:
                yield (LORA_SCALING if adapter is None else f"{LORA_SCALING}.{adapter}"), scaling
                yield from sglang_lora.sync_names(adapter, self.adapters.get(adapter, {}))
            return
        for name in self._last_names:
            values = self._call("get_weights_by_name", self._engine.get_weights_by_name, self._engine_name(name),
                                truncate_size=self.opts.check_weights_truncate)
            if values is None:
                # Models without get_weights_by_name (every Qwen class in sglang 0.5.23: model_runner_components/
                # weight_exporter.py) answer None. The name is kept, with None, so a weight check fails on it
                # (milehpc.weights.check) instead of passing without it; the logprob check still covers the sync.
                self.unreadable.add(name)
                yield name, None
                continue
            yield name, torch.as_tensor(values).flatten()

    # ---- colocated memory ----------------------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Offload rollout: cuda graphs, KV cache and weights (SGLang ``release_memory_occupation``)."""
        if self.is_leader:
            with self._lock:
                self._call("release_memory_occupation", self._engine.release_memory_occupation,
                           tags=list(sm.OFFLOAD_TAGS))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Onload ``["weights"]`` before an update and ``["kv_cache", "cuda_graph"]`` after it."""
        if self.is_leader:
            with self._lock:
                self._call("resume_memory_occupation", self._engine.resume_memory_occupation,
                           tags=list(tags) if tags is not None else None)

    def state_dict(self) -> dict[str, Any]:
        """Nothing: SGLang's sampling state is not readable (seeded requests are, see ``sglang_mapping``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`state_dict`."""

    def info(self) -> dict[str, Any]:
        return {"name": "sglang", "engine": self.engine_index, "engine_rank": self.engine_rank,
                "tp_size": self.server_args.get("tp_size", 1), "version": self.version, "restarts": self.restarts,
                "tokens_generated": self.tokens_generated, "colocated": self.colocated,
                "weights_truncated_to": self.opts.check_weights_truncate,
                "speculative": self.server_args.get("speculative_algorithm")}


def route_payloads(gathered: list[Any], tp_size: int) -> list[Any]:
    """The leader's list of per-rank weight payloads, gathered over the engine's ranks in engine-rank order (engine
    rank r drives TP rank r on its own GPU): one per TP rank, none missing."""
    if len(gathered) != tp_size or any(p is None for p in gathered):
        have = [i for i, p in enumerate(gathered) if p is not None]
        raise RuntimeFailure(f"expected one weight payload per TP rank (0..{tp_size - 1}), got ranks {have}")
    return list(gathered)


def require_amx_hook() -> None:
    """One line instead of the scheduler's death at its first weight update: a CPU engine on a CPU with AMX needs the
    start-up hook that turns sglang's AMX path off (``AMX_OFF_ENV``)."""
    import importlib.util

    import torch

    if torch.cpu._is_amx_tile_supported() and importlib.util.find_spec("_milehpc_sglang_cpu_hook") is None:
        raise RuntimeFailure("this CPU has AMX, and sglang's AMX path takes no weight updates: install milehpc's "
                             "sglang start-up hook, which turns it off (bash scripts/setup-sglang-cpu.sh)")


def cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the cpu-list form libnuma's ``numa_parse_cpustring`` reads)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _check_result(what: str, result: Any) -> None:
    """SGLang weight calls answer ``(success, message)`` (or an object with them); failure is one clear error."""
    ok, message = True, ""
    if isinstance(result, tuple) and result:
        ok, message = bool(result[0]), str(result[1]) if len(result) > 1 else ""
    elif hasattr(result, "success"):
        ok, message = bool(result.success), str(getattr(result, "message", ""))
    if not ok:
        raise RuntimeFailure(f"SGLang {what} failed: {message}")


def engine_layout(ctx: Any) -> sm.EngineLayout:
    """This rank's place in its engine; multi-rank engines agree on the leader's address over MPI."""
    plan, rank = ctx.plan, ctx.comms.rank
    engine, engine_rank = plan.engine_of(rank)
    port = ENGINE_PORT_BASE + (engine % 64) * 16
    addr = None
    if plan.gpus_per_engine > 1:
        from milehpc.comm.net import free_port, resolve_address

        leader = plan.engine_leaders()[engine]
        members = list(range(leader, leader + plan.gpus_per_engine))
        mine = None
        if engine_rank == 0:
            host = resolve_address("127.0.0.1" if plan.nodes == 1 else "hostname")
            mine = f"{host}:{free_port()}"
        addr = ctx.comms.bcast(mine, leader, members, what=f"engine {engine}'s SGLang rendezvous address")
    return sm.EngineLayout(engine=engine, engine_rank=engine_rank, gpus_per_engine=plan.gpus_per_engine,
                           dist_init_addr=addr, port=port, base_gpu_id=base_gpu_id(ctx))


def base_gpu_id(ctx: Any) -> int:
    """The GPU (as this process sees it) this rank's SGLang scheduler takes: the one the rank was bound to at start-up
    (:func:`milehpc.comm.devices.bind_device`, the trainer's too when colocated), else the plan's for the site's
    GPU binding; 0 without GPUs."""
    device = getattr(ctx.comms, "device", None)
    if device is not None and device.type == "cuda" and device.index is not None:
        return int(device.index)
    return ctx.plan.device_index(ctx.comms.rank) or 0


def from_context(ctx: Any, *, engine_factory: Any = None) -> SGLangEngine:
    """Engine factory (``impl(ctx)``) for ``rollout.engine = "sglang"`` (``engine_factory``: tests' stand-in)."""
    from milehpc.config.precision import resolve_precision
    from milehpc.data.tokenizer import build_tokenizer

    job = ctx.job
    opts = parse_options(job.rollout.options)
    precision = resolve_precision(job)
    tokenizer = build_tokenizer(job.model.tokenizer)
    path, random_init = model_folder(ctx, tokenizer.vocab_size, int(tokenizer.pad_id), int(tokenizer.eos_id))
    if job.trainer.lora is not None and random_init:  # only the adapter is synced: SGLang loads the trainer's base
        writer = ctx.comms.rank == min(ctx.plan.engine_leaders() or [0])
        path, random_init = sglang_lora.seeded_base_folder(job, Path(ctx.run_dir), writer=writer), False
    layout = engine_layout(ctx)
    # Stop strings come with a tokenizer folder (the job rules refuse the toy tokenizer on the login node).
    tok_path = job.model.tokenizer if job.rollout.stop and Path(job.model.tokenizer).is_dir() else None
    args = sm.server_args(job, opts, precision, layout, model_path=path, tokenizer_path=tok_path)
    if random_init:
        args["load_format"] = "dummy"
    import torch

    if not torch.cuda.is_available():
        args = {**CPU_SERVER_ARGS, **args}
        if job.resources.colocate:
            args = cpu_colocated_args(args, opts)
    if job.trainer.lora is not None:
        args.update(sglang_lora.server_args(job.trainer.lora, cpu=args.get("device") == "cpu"))
    args = rl_quantization_args(args, random_init=random_init)
    if engine_factory is None:
        from milehpc.config.sglang_options import check_against_server_args

        check_against_server_args(args, extra=opts.server_args)
    if opts.spec is not None and opts.spec.draft_model_path and not Path(opts.spec.draft_model_path).is_dir():
        raise ConfigError(f"expected a local folder, got {opts.spec.draft_model_path!r}",
                          field="rollout.options.speculative.draft_model_path")
    moe = (job.model.num_layers, job.model.moe_top_k) if job.model.num_experts else None
    vision = vision_of(job, tokenizer)
    gather = None
    if job.resources.colocate and layout.gpus_per_engine > 1:
        leader = ctx.plan.engine_leaders()[layout.engine]
        members = list(range(leader, leader + layout.gpus_per_engine))

        def gather(payload: Any) -> Any:
            return ctx.comms.gather(payload, leader, members, what=f"engine {layout.engine}'s weight payloads")
    return SGLangEngine(job, args, opts, engine=layout.engine, engine_rank=layout.engine_rank,
                        eos_id=int(tokenizer.eos_id), moe_shape=moe, colocated=job.resources.colocate,
                        version=-1 if random_init else 0, engine_factory=engine_factory, gather=gather,
                        lora=job.trainer.lora, vision=vision)


def vision_of(job: Any, tokenizer: Any) -> Vision | None:
    """The image side of the job's model when it is a vision-language checkpoint (None for a text model)."""
    from milehpc.config.families import VISION_FAMILIES, folder_model_type

    model_type = folder_model_type(job.model.path) if job.model.path else None
    if model_type not in VISION_FAMILIES:
        return None
    from milehpc.data.images import tokenizer_folder

    return Vision(folder=tokenizer_folder(tokenizer), model_type=str(model_type), frozen=job.model.freeze_vision)
