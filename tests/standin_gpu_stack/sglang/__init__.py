"""CPU stand-in for ``sglang.Engine``: the methods milehpc calls, with SGLang's keyword arguments and output shapes,
generating with milehpc's reference engine on the config in ``model_path``.

Used by tests/test_sglang_gpu_check_script.py and the colocated loop tests (tests/test_sglang_loop_standin.py,
tests/test_colocated_checkpoint_order.py: weights in place through ``update_weights_from_tensor``; the separate-ranks
update group runs against the real engine in tests/test_sglang_contract.py and tests/test_sglang_loop_real.py). It also
* starts one child process, as SGLang starts its scheduler, so milehpc's health check watches a real process;
  ``MILEHPC_STANDIN_CRASH="RANK:CALL:N"`` kills the first engine's child on that MPI rank after its N-th call of
  ``CALL`` (``generate`` or ``resume_memory_occupation``);
* records every call as one JSON line in ``$MILEHPC_STANDIN_LOG/rank<R>.jsonl`` when that variable is set.

It stands in for the engine process only: ``sglang.srt`` (``ServerArgs``, ``io_struct``, the serializer) is the REAL
installed sglang's, reached through this package's ``__path__``, so milehpc's argument check and its weight-update
requests are built against the real definitions (the tests using this stand-in need sglang installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__version__ = "standin"


def _real_sglang_dir() -> str | None:
    """The installed sglang package folder (not this one), for ``sglang.srt``."""
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        candidate = Path(entry or ".") / "sglang"
        if (candidate / "srt" / "server_args.py").is_file() and candidate.resolve() != here:
            return str(candidate)
    return None


_REAL = _real_sglang_dir()
if _REAL:
    __path__.append(_REAL)  # noqa: F821 - a package's own __path__
_STARTED = [0]  # engines started in this process (a crash is staged on the first one only)


def record(call: str, **info) -> None:
    folder = os.environ.get("MILEHPC_STANDIN_LOG")
    if folder:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        with open(Path(folder) / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"call": call, **info}) + "\n")


class Engine:
    def __init__(self, *, model_path: str, load_format: str = "auto", random_seed: int = 0, **server_args) -> None:
        import transformers as tf

        from milehpc.data.tokenizer import build_tokenizer
        from milehpc.rollout.reference import ReferenceEngine

        config = tf.AutoConfig.from_pretrained(Path(model_path))
        model = tf.AutoModelForCausalLM.from_config(config).to(getattr(__import__("torch"), server_args.get(
            "dtype", "float32")))
        self.ref = ReferenceEngine(model, build_tokenizer("toy"), seed=random_seed)
        self.server_args = server_args
        self.released: set[str] = set()
        self.groups: dict = {}
        self.calls: dict[str, int] = {}
        _STARTED[0] += 1
        self.instance = _STARTED[0]
        crash = os.environ.get("MILEHPC_STANDIN_CRASH", "")
        rank, call, after = crash.split(":") if crash else ("", "", "0")
        self.crash_at = (call, int(after)) if rank == os.environ.get("OMPI_COMM_WORLD_RANK") \
            and self.instance == 1 else None
        # The "scheduler": a real child process, watched by milehpc's health check.
        # It ends with its parent (as SGLang's do) and holds none of the rank's output pipes.
        watch = f"import os, time\nwhile os.getppid() == {os.getpid()}: time.sleep(0.2)"
        self.child = subprocess.Popen([sys.executable, "-c", watch], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        record("Engine", instance=self.instance, load_format=load_format)
        from sglang_requests import attach  # beside this package, on the job's PYTHONPATH

        attach(self, record)

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, return_routed_experts=False,
                 **_):
        from milehpc.rollout.engine import SamplingParams

        assert return_logprob and not (self.released & {"weights", "kv_cache"})
        record("generate", prompts=len(input_ids))
        self._count("generate")
        outs = []
        for ids, sp in zip(input_ids, sampling_params, strict=True):
            params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"], top_k=max(sp["top_k"], 0),
                                    max_new_tokens=sp["max_new_tokens"], stop_token_ids=sp.get("stop_token_ids", []))
            new, lps, stopped = self.ref._decode([ids], params)
            finish = {"type": "stop", "matched": new[0][-1]} if stopped[0] else {"type": "length",
                                                                                  "length": len(new[0])}
            outs.append({"output_ids": new[0], "meta_info": {
                "finish_reason": finish, "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps[0], new[0],
                                                                                                  strict=True)]}})
        return outs

    def _count(self, call: str) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1
        if self.crash_at == (call, self.calls[call]):
            self.child.kill()  # the scheduler dies after answering; the next health check sees it
            self.child.wait()  # dead before this returns, however loaded the machine

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        record("update_weights_from_tensor", names=len(named_tensors), flush_cache=flush_cache)
        self.ref.update_weights(named_tensors, self.ref.version)
        return True, "Succeeded"

    def get_weights_by_name(self, name, truncate_size=100):
        return self.ref.model.state_dict()[name].flatten()[:truncate_size].float().tolist()

    def release_memory_occupation(self, tags=None):
        record("release_memory_occupation", tags=tags)
        self.released |= set(tags or ["weights", "kv_cache", "cuda_graph"])

    def resume_memory_occupation(self, tags=None):
        record("resume_memory_occupation", tags=tags)
        self.released -= set(tags or ["weights", "kv_cache", "cuda_graph"])
        self._count("resume_memory_occupation")

    def flush_cache(self):
        record("flush_cache")
        return True

    def shutdown(self):
        import torch.distributed as dist

        record("shutdown", instance=self.instance)
        for pg in self.groups.values():  # real SGLang loses them with its scheduler process
            dist.destroy_process_group(pg)
        self.groups.clear()
        self.child.kill()
        self.child.wait()
        self.ref = None

