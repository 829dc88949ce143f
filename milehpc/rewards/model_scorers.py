"""Model rewards, as ``batch`` reward plugins the job names (their parameters: :mod:`milehpc.builtin.rewards`):

- ``reward_model``: a learned classifier RM, ``AutoModelForSequenceClassification`` from a local folder. Each sample
  is scored on the RM tokenizer's chat template of ``[user: prompt, assistant: response]`` when it has one (else
  prompt + response as text), in batches, the logit ``label_index`` normalised (``none`` | ``sigmoid`` |
  ``standard``).
- ``judge`` (:mod:`milehpc.rollout.judge`: it generates on an engine): a generative judge, ``template`` filled
  with the sample's prompt, response and label, the judge's answer parsed with :func:`parse_answer`.

Either combines with rule rewards through ``combine`` (weights; ``gate``: the judge asked only where the format is
right). Scoring never makes up a number: a failed forward pass is tried again (``retries``), an answer that does not
parse is asked again, sampled; a sample still without a score fails (``FAILED``, counted in ``reward/failed`` and
``rollout/failed``) and the loss ignores it. The reward's own ``timeout_s`` bounds each call (the model runs in a
worker thread). Each returned value carries the raw model output (``rm_logit`` / ``judge_answer``) and the tries
it took (``*_retries``), which become ``reward/*`` metrics. Models are loaded once per process and path.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError
from milehpc.samples import Sample

log = logging.getLogger(__name__)
_LOADED: dict[tuple[str, ...], Any] = {}
_LOCK = threading.Lock()  # one load per key, even with several scorers in flight


def model_folder(path: str, file: str | None = None, field: str = "path") -> Path:
    """``path`` as a folder, or one line naming ``reward.params.<field>``."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"expected a local model folder, got {path!r} (download it first)", file=file,
                          field=f"reward.params.{field}")
    return folder


def cached(key: tuple[str, ...], load: Any) -> Any:
    """``load()`` once per process and ``key`` (a model is loaded once, whichever scorer asks)."""
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = load()
        return _LOADED[key]


def prompt_text(sample: Sample) -> str:
    """The sample's prompt as text (chat messages: their contents, one a line)."""
    prompt: Any = sample.prompt_text
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt)
    return str(prompt or "")


def _with_retries(what: str, retries: int, fn: Any) -> tuple[Any, int]:
    """``fn()`` tried ``1 + retries`` times; (its value, the failed tries before it). Re-raises the last error."""
    for attempt in range(retries + 1):
        try:
            return fn(), attempt
        except Exception as err:  # a model call that fails is tried again, then the caller fails its samples
            if attempt == retries:
                raise
            log.warning("%s failed (try %d of %d): %s: %s", what, attempt + 1, retries + 1, type(err).__name__, err)
    raise AssertionError("unreachable")


# -- released while another model uses the device ([reward_model] colocate = "rollout") ------------------------

class DeviceWeights:
    """A frozen model's tensors (parameters and buffers) taken off their device while the rollout engine generates,
    and put back before it scores. Why not torch_memory_saver (what :mod:`milehpc.runtime.offload` pauses the
    trainer with): the model never changes, so a host copy made once is always current — a release only drops the
    device tensors (no copy back) and a restore is one host-to-device copy from pinned memory, the transfer a
    paused region with a CPU backup would make too; and plain tensor moves need no CUDA-only package, no hook mode
    shared with the trainer's saver in a colocated rank, and run on AMD GPUs and CPUs alike. The memory goes back
    to the driver (``empty_cache``): SGLang's and vLLM's schedulers are other processes.

    On a CPU the host copy is the tensor itself (nothing is freed: the memory estimate counts it so) and a release
    still swaps in empty tensors, so a forward pass between release and restore fails instead of running."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.host: dict[str, Any] = {}  # name -> the host copy (pinned for a GPU tensor)
        self.device: dict[str, Any] = {}  # name -> where it lives when restored
        self.released = False

    def _tensors(self) -> list[tuple[str, Any]]:
        # named_parameters drops duplicates: a tied embedding is one Parameter, released once for both users.
        return [*self.module.named_parameters(), *(("buffer:" + n, b) for n, b in self.module.named_buffers())]

    def resident_bytes(self) -> int:
        """Bytes the model's tensors hold now (0 while released)."""
        return sum(t.numel() * t.element_size() for _, t in self._tensors())

    def release(self) -> int:
        """Drop the device tensors (the first time, copy them to the host); returns the bytes dropped."""
        import torch

        if self.released:
            return 0
        freed = self.resident_bytes()
        for name, t in self._tensors():
            if name not in self.host:
                self.device[name] = t.device
                # one pinned host copy, written straight from the device (no pageable copy on the way)
                self.host[name] = (torch.empty_like(t, device="cpu", pin_memory=True).copy_(t.detach()) if t.is_cuda
                                   else t.detach())
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.released = True
        if any(d.type == "cuda" for d in self.device.values()):
            torch.cuda.empty_cache()  # back to the driver, for the engine's own processes
        return freed

    def restore(self) -> None:
        """Put the tensors back on their devices (one copy each from the host)."""
        if not self.released:
            return
        for name, t in self._tensors():
            t.data = self.host[name].to(self.device[name], non_blocking=True)
        if any(d.type == "cuda" for d in self.device.values()):
            import torch

            torch.cuda.synchronize()  # the copies are done before the first forward pass reads them
        self.released = False


_COLOCATED = threading.Event()  # set on a rollout rank that scores beside its engine (reward_side.ColocatedScoring)


def colocate_here() -> None:
    """This process's model scorers share the device with its rollout engine (loaded ones are released while it
    generates; a judge engine started from now on keeps what it needs to come back, see milehpc.rollout.judge)."""
    _COLOCATED.set()


def colocated_here() -> bool:
    return _COLOCATED.is_set()


def release_models() -> int:
    """Release every model scorer loaded in this process (see :class:`DeviceWeights`); the bytes released."""
    with _LOCK:
        held = list(_LOADED.values())
    return sum(m.release() for m in held if hasattr(m, "release"))


@contextmanager
def models_on_device() -> Iterator[None]:
    """The released model scorers back on the device for a scoring outside a step's generate-and-score (the
    evaluation), and off again after it; nothing where this process colocates none."""
    if not colocated_here():
        yield
        return
    restore_models()
    try:
        yield
    finally:
        release_models()


def restore_models() -> None:
    """Restore what :func:`release_models` released."""
    with _LOCK:
        held = list(_LOADED.values())
    for m in held:
        if hasattr(m, "restore"):
            m.restore()


# -- the classifier RM ----------------------------------------------------------------------------------------

class ClassifierRM:
    """A sequence-classification RM held in this process (see the module docstring)."""

    def __init__(self, path: str, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = model_folder(path)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if self.tokenizer.pad_token_id is None:  # batches need a pad token; the model finds the last real one
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True)
        self.model.to(self.device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.lock = threading.Lock()  # one forward pass at a time per model
        self.weights = DeviceWeights(self.model)

    def release(self) -> int:
        """Off the device while the rollout engine generates (``[reward_model] colocate = "rollout"``)."""
        with self.lock:
            return self.weights.release()

    def restore(self) -> None:
        with self.lock:
            self.weights.restore()

    def text(self, prompt: str, response: str, chat_template: bool) -> str:
        """What the RM reads for one sample."""
        if chat_template and self.has_chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return prompt + response

    def logits(self, texts: list[str], *, label_index: int = 0, max_length: int = 0) -> list[float]:
        """The RM's logit ``label_index`` for each text, in one forward pass."""
        import torch

        self.tokenizer.truncation_side = "left"  # keep the response's end, where the RM reads its score
        enc = self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False,
                             truncation=max_length > 0, max_length=max_length or None)
        with self.lock, torch.no_grad():
            out = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits.float()
        if label_index >= out.shape[-1]:
            raise ValueError(f"label_index {label_index} is out of range: the RM has {out.shape[-1]} labels")
        return out[:, label_index].tolist()


def normalized(logit: float, how: str, mean: float = 0.0, std: float = 1.0) -> float:
    """The RM's score from its logit: ``none``, ``sigmoid`` or ``standard`` ((logit - mean) / std)."""
    if how == "sigmoid":
        return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))
    if how == "standard":
        return (logit - mean) / std
    return logit


def load_classifier(path: str, device: str = "cpu") -> ClassifierRM:
    """The RM of ``path`` on ``device``, loaded once per process."""
    return cached(("classifier", str(Path(path).resolve()), device), lambda: ClassifierRM(path, device))


def score_classifier(samples: Sequence[Sample], *, path: str, batch_size: int = 32, chat_template: bool = True,
                     label_index: int = 0, normalize: str = "none", mean: float = 0.0, std: float = 1.0,
                     max_length: int = 0, retries: int = 1, device: str = "cpu") -> list[Any]:
    """One value per sample: ``{"score", "rm_logit", "rm_retries"}``, or the exception that failed its batch."""
    rm = load_classifier(path, device)
    out: list[Any] = []
    for start in range(0, len(samples), batch_size):
        part = samples[start:start + batch_size]
        texts = [rm.text(prompt_text(s), s.response_text, chat_template) for s in part]
        try:
            logits, tries = _with_retries(f"reward model {path}", retries,
                                          lambda t=texts: rm.logits(t, label_index=label_index, max_length=max_length))
        except Exception as err:  # this batch's samples fail (the runner marks them FAILED); the others go on
            out += [err] * len(part)
            continue
        for logit in logits:
            if not math.isfinite(logit):
                out.append(ValueError(f"the reward model gave a non-finite logit ({logit})"))
                continue
            out.append({"score": normalized(logit, normalize, mean, std), "rm_logit": logit,
                        "rm_retries": float(tries)})
    return out


async def reward_model(samples: Sequence[Sample], **params: Any) -> list[Any]:
    """The ``reward_model`` reward: :func:`score_classifier` in a worker thread (so ``reward.timeout_s`` holds)."""
    return await asyncio.to_thread(score_classifier, samples, **params)


def _validate_classifier(params: dict[str, Any], file: str | None = None) -> None:
    model_folder(params["path"], file)


reward_model.validate_params = _validate_classifier  # type: ignore[attr-defined]


def parse_answer(text: str, pattern: str, answer_map: dict[str, float], scale: float = 1.0) -> float | None:
    """The judge's grade in ``text`` divided by ``scale``, or None when there is none (no match, not a number,
    not in ``answer_map``)."""
    match = re.search(pattern, text)
    if match is None:
        return None
    found = (match.group(1) if match.groups() else match.group(0)).strip()
    if answer_map:
        value = answer_map.get(found)
        return None if value is None else value / scale
    try:
        value = float(found)
    except ValueError:
        return None
    return value / scale if math.isfinite(value) else None
