"""The ``judge`` reward: a generative judge (a causal LM from a local folder) asked with the job's ``template``
(fields ``{prompt}``, ``{response}``, ``{label}``) and graded by :func:`milehpc.rewards.model_scorers.parse_answer`.
Greedy first; an answer without a grade is asked again, sampled at ``retry_temperature``, up to ``retries`` times; a
sample still without a grade fails (never scored 0). Its parameters are declared in :mod:`milehpc.builtin.rewards`.

The judge generates on an engine plugin, the one its ``engine`` names: ``reference`` holds the judge (any HF causal
LM) in this process; any other (``sglang``, ``vllm``, a third party's) is built by the plugin's own factory, exactly
as a rollout rank builds its engine (``impl(ctx)``), from a context of one engine on this process's device whose
job is the judge's folder, tokenizer and ``engine_options`` (that engine's ``rollout.options``, checked on the login
node by :func:`milehpc.config.reward_model.check_judge_engine`). So the judge's SGLang is started and budgeted
(``cpu_memory_gib``, ``mem_fraction_static``; vLLM's ``kv_cache_gib``) as the policy's is; a judge engine that dies
is not restarted (its samples fail and are counted, as any scorer failure is).

The reference judge runs on the CPU, as before engines were pluggable, unless it shares its rank's device with the
rollout engine (``[reward_model] colocate = "rollout"``), where it is released while that engine generates."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milehpc.rewards.model_scorers import DeviceWeights, cached, model_folder, parse_answer, prompt_text
from milehpc.samples import Sample

log = logging.getLogger(__name__)


@dataclass
class _OneRank:
    """The communicator part an engine factory reads, for an engine of one rank (the judge's): nothing to share."""

    rank: int = 0
    size: int = 1
    device: Any = None  # torch.device of this process's GPU; None on a CPU
    timeout: float = 600.0


def _device() -> Any:
    """This process's GPU (the one the rank bound, or the scorer process's only one), else None."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def plugin_engine(engine: str, options: dict[str, Any], folder: Path, tokenizer: str, seed: int, *,
                  colocated: bool = False) -> Any:
    """The engine plugin ``engine`` serving the judge of ``folder``, built by the plugin's factory as a rollout rank
    builds its own (a one-engine plan on this process's device). ``colocated``: the judge shares the device with the
    rollout engine and is released while that generates (SGLang then runs with its memory saver and a CPU copy of
    the weights, which its release would otherwise drop: they are not synced back like the policy's)."""
    from milehpc import plugins
    from milehpc.comm.context import RunContext
    from milehpc.config.load import job_from_dict
    from milehpc.plan import Plan

    device = _device()
    opts = dict(options)
    if colocated and device is not None and engine == "sglang":
        opts["server_args"] = {**opts.get("server_args", {}), "enable_weights_cpu_backup": True}
    job = job_from_dict({"name": "judge", "model": {"path": str(folder), "tokenizer": tokenizer},
                         "rollout": {"engine": engine, "options": opts}, "run": {"seed": seed},
                         "resources": {"colocate": colocated}}, file="<judge>")
    import torch

    gpu = device is not None
    vendor = ("amd" if torch.version.hip else "nvidia") if gpu else "none"
    plan = Plan(job_name="judge", site="", partition="", nodes=1, ranks_per_node=1, world_size=1, colocated=False,
                device_vendor=vendor, backend="nccl" if gpu else "gloo", gpus_per_rank=int(gpu),
                trainer_ranks=0, tp=1, pp=1, dp=1, ep=1, rollout_first=0, rollout_ranks=1, engines=1,
                gpus_per_engine=1)
    ctx = RunContext(job, plan, _OneRank(device=device), run_dir=Path.cwd())  # type: ignore[arg-type]
    return plugins.load("engine", engine, field="reward.params.engine")(ctx)


class Judge:
    """A causal LM asked to grade, generating on its engine plugin (see the module docstring)."""

    def __init__(self, path: str, tokenizer: str = "", seed: int = 0, engine: str = "reference",
                 engine_options: dict[str, Any] | None = None, colocated: bool = False) -> None:
        from milehpc.data.tokenizer import build_tokenizer

        folder = model_folder(path)
        tok_name = tokenizer or str(folder)
        tok_name = tok_name if tok_name == "toy" else str(model_folder(tok_name, field="tokenizer"))
        self.tokenizer = build_tokenizer(tok_name)
        self.engine_name = engine
        self.weights: DeviceWeights | None = None
        if engine == "reference":
            from transformers import AutoModelForCausalLM

            from milehpc.rollout.reference import ReferenceEngine

            model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
            # on the GPU only beside its own rollout engine, released while that generates (module docstring)
            device = (_device() if colocated else None) or "cpu"
            self.engine = ReferenceEngine(model, self.tokenizer, device=device, seed=seed)
            self.weights = DeviceWeights(self.engine.model)
        else:
            self.engine = plugin_engine(engine, engine_options or {}, folder, tok_name, seed, colocated=colocated)
        self.lock = threading.Lock()  # the engine's sampling stream is not shared between threads

    def answers(self, prompts: list[str], *, chat_template: bool, max_new_tokens: int,
                temperature: float) -> list[str]:
        """The judge's answer text for each judge prompt (greedy at temperature 0)."""
        from milehpc.rollout.engine import SamplingParams

        ids = [self.tokenizer.encode_prompt(p, chat_template=chat_template) for p in prompts]
        sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=1)
        with self.lock:
            out = self.engine.generate(ids, sp)
        if len(out) != len(ids):
            raise RuntimeError(f"the judge's {self.engine_name} engine answered {len(out)} of {len(ids)} prompts")
        # decoded here, one way whichever engine (the engine plugins return ids; the rollout side decodes theirs)
        return [self.tokenizer.decode(s.response_ids) for s in out]

    def release(self) -> int:
        """Off the device while the rollout engine generates: the reference judge's tensors, or the engine's own
        release (SGLang's memory saver; nothing where the engine holds nothing to release). The bytes released
        where known."""
        with self.lock:
            if self.weights is not None:
                return self.weights.release()
            if _device() is not None:  # on a CPU the engine has no memory saver and nothing would be freed
                self.engine.release_memory()
            return 0

    def restore(self) -> None:
        with self.lock:
            if self.weights is not None:
                self.weights.restore()
            elif _device() is not None:
                self.engine.resume_memory(None)

    def shutdown(self) -> None:
        self.engine.shutdown()


def load_judge(path: str, tokenizer: str = "", seed: int = 0, engine: str = "reference",
               engine_options: dict[str, Any] | None = None) -> Judge:
    """The judge of ``path`` on ``engine``, loaded once per process."""
    import json

    from milehpc.rewards.model_scorers import colocated_here

    key = ("judge", str(model_folder(path).resolve()), tokenizer, str(seed), engine,
           json.dumps(engine_options or {}, sort_keys=True))
    return cached(key, lambda: Judge(path, tokenizer, seed, engine, engine_options, colocated=colocated_here()))


def score_judge(samples: Sequence[Sample], *, path: str, tokenizer: str = "", engine: str = "reference",
                engine_options: dict[str, Any] | None = None, template: str = "{prompt}{response}",
                chat_template: bool = False,
                answer_pattern: str = r"(-?\d+(?:\.\d+)?)", answer_map: dict[str, float] | None = None,
                scale: float = 1.0, max_new_tokens: int = 16, batch_size: int = 32, retries: int = 2,
                retry_temperature: float = 1.0, seed: int = 0) -> list[Any]:
    """One value per sample: ``{"score", "judge_answer", "judge_retries"}``, or why it has none. Answers that do
    not parse are asked again, sampled at ``retry_temperature``, up to ``retries`` times."""
    judge = load_judge(path, tokenizer, seed, engine, engine_options)
    prompts = [template.format(prompt=prompt_text(s), response=s.response_text, label=s.label or "") for s in samples]
    out: list[Any] = [None] * len(samples)
    tries = [0] * len(samples)
    todo = list(range(len(samples)))
    last: dict[int, str] = {}
    for attempt in range(retries + 1):
        temperature = 0.0 if attempt == 0 else retry_temperature
        for start in range(0, len(todo), batch_size):
            part = todo[start:start + batch_size]
            try:
                answers = judge.answers([prompts[i] for i in part], chat_template=chat_template,
                                        max_new_tokens=max_new_tokens, temperature=temperature)
            except Exception as err:  # the engine failed this batch: its samples are tried again
                log.warning("judge %s failed on %d prompts: %s: %s", path, len(part), type(err).__name__, err)
                for i in part:
                    last[i] = f"{type(err).__name__}: {err}"
                continue
            for i, answer in zip(part, answers, strict=True):
                grade = parse_answer(answer, answer_pattern, answer_map or {}, scale)
                if grade is None:
                    last[i] = f"no grade in the judge's answer {answer[:80]!r}"
                else:
                    out[i] = {"score": grade, "judge_answer": grade * scale, "judge_retries": float(attempt)}
        todo = [i for i in todo if out[i] is None]
        for i in todo:
            tries[i] += 1
        if not todo:
            break
    for i in todo:
        out[i] = RuntimeError(f"judge gave no grade in {tries[i]} tries: {last.get(i, '?')}")
    return out


async def judge(samples: Sequence[Sample], **params: Any) -> list[Any]:
    """The ``judge`` reward: :func:`score_judge` in a worker thread (so ``reward.timeout_s`` holds)."""
    return await asyncio.to_thread(score_judge, samples, **params)


def _validate_judge(params: dict[str, Any], file: str | None = None) -> None:
    model_folder(params["path"], file)
    if params.get("tokenizer") not in ("", "toy", None):
        model_folder(params["tokenizer"], file, "tokenizer")


judge.validate_params = _validate_judge  # type: ignore[attr-defined]
