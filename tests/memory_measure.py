"""The real footprint of a trainer rank on the CPU, to check milehpc.memory's estimate against (tests/test_memory.py
and tests/memory_mpi_checks.py): parameter, gradient and optimizer-state bytes summed from the live tensors, and the
activations as the bytes of every distinct storage autograd saves for the backward of one micro-batch (parameters
excluded; they are counted as parameters)."""

from __future__ import annotations

from typing import Any


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes(optimizer: Any) -> int:
    """Every tensor in a torch optimizer's state (moments, step counters, fp32 master copies kept there)."""
    import torch

    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))


class SavedTensors:
    """Context manager: the bytes of the distinct storages autograd saves inside it, parameters excluded."""

    def __init__(self, params: Any) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def _pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> SavedTensors:
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def full_length_samples(n: int, prompt: int, response: int, vocab: int, group: int = 8) -> list[Any]:
    """``n`` samples of exactly ``prompt`` + ``response`` tokens (the longest the job makes)."""
    from milehpc.samples import Sample

    return [Sample(prompt_ids=[3 + (i + j) % (vocab - 3) for j in range(prompt)],
                   response_ids=[3 + (i * 7 + j) % (vocab - 3) for j in range(response)], reward=float(i % 2),
                   group=i // group, index=i) for i in range(n)]


def measure_torch_trainer(job: Any) -> dict[str, int]:
    """One torch-trainer rank of ``job`` on the CPU: parameters, gradients and Adam state after one micro-batch's
    backward and an optimizer step, and the activations of that micro-batch (prompt length: the task's longest)."""
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.train.torch_trainer import TorchTrainer

    tok = build_tokenizer(job.model.tokenizer)
    trainer = TorchTrainer(job, tok)
    source = build_source(job.data, tok)
    prompt = max(len(source.peek(i).ids) for i in range(512))
    params = list(trainer.module.parameters())
    samples = full_length_samples(job.trainer.micro_batch_size, prompt, job.rollout.max_new_tokens, tok.vocab_size)
    batch = trainer._batch(samples)
    trainer.model.train()
    with SavedTensors(params) as saved:
        logp, _ = trainer.forward(trainer.model, batch)
        loss = -(logp * batch.response_mask).sum() if hasattr(batch, "response_mask") else -logp.sum()
    loss.backward()
    grads = tensor_bytes(p.grad for p in params if p.grad is not None)
    trainer.optimizer.step()
    return {"params": tensor_bytes(params), "grads": grads, "optimizer": optimizer_bytes(trainer.optimizer),
            "activations": saved.bytes, "prompt_tokens": prompt, "vocab": tok.vocab_size}


# ---- peaks: a rank's resident memory at its highest, against the estimate's total --------------------------------
# glibc returns an allocation above its mmap threshold to the system when it is freed; the threshold otherwise grows
# to 32 MiB as large blocks are freed, and a freed block below it stays resident (and is reused), so the high-water
# mark would carry what earlier work left behind. The measuring process starts with a fixed small threshold.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_growth(work: Any) -> tuple[int, Any]:
    """(bytes the resident set grew by at its highest while ``work()`` ran, what it returned). The kernel's
    high-water mark is reset first (/proc/self/clear_refs "5", Linux >= 4.0)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    base = _status("VmRSS")
    out = work()
    return _status("VmHWM") - base, out


# CPU runs of several sizes (overrides of examples/cpu-demo.toml) whose peaks tests/test_memory.py compares with the
# estimate: large enough that the tensors, not the interpreter's own allocations, make the peak (the demo's own
# 4 MiB engine does not), small enough to take seconds. One per MPI rank of tests/memory_mpi_checks.py.
PEAK_SIZES = [
    ("model.hidden_size=256", "model.intermediate_size=512", "model.num_layers=4", "model.num_kv_heads=4",
     "model.max_position_embeddings=128", "rollout.max_new_tokens=32", "rollout.prompts_per_step=4",
     "trainer.micro_batch_size=32"),
    ("model.hidden_size=512", "model.intermediate_size=1024", "model.num_layers=2", "model.num_heads=8",
     "model.num_kv_heads=8", "model.max_position_embeddings=128", "rollout.max_new_tokens=24",
     "rollout.prompts_per_step=4", "rollout.n_samples=16", "trainer.micro_batch_size=64"),
]
# The imports and one-off allocations of a first engine and trainer, done before anything is measured.
WARM_UP = ("rollout.prompts_per_step=1", "trainer.micro_batch_size=8")


def measure_peaks(job: Any) -> dict[str, int]:
    """A reference-engine rank's peak over building it and generating its share of one step (the longest prompt,
    every sample to max_new_tokens), then a CPU trainer rank's over building it and two train steps on those
    samples; each is the growth of the process's resident memory."""
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.rollout.reference import build_engine, sampling_from_spec
    from milehpc.train.torch_trainer import TorchTrainer

    tok = build_tokenizer(job.model.tokenizer)
    source = build_source(job.data, tok)
    prompt = max((source.peek(i).ids for i in range(512)), key=len)
    ro = job.rollout

    def generate() -> list[Any]:
        engine = build_engine(job)
        engine.eos_id = -1  # every sample runs to max_new_tokens: the longest the job makes
        return engine.generate([list(prompt)] * ro.prompts_per_step, sampling_from_spec(ro, tok))

    def train() -> None:
        trainer = TorchTrainer(job, tok)
        for step in range(2):
            trainer.train_step(samples, step)

    engine_peak, samples = peak_growth(generate)
    for i, s in enumerate(samples):
        s.reward, s.index = float(i % 3 == 0), i
    trainer_peak, _ = peak_growth(train)
    return {"trainer": trainer_peak, "rollout": engine_peak, "samples": len(samples),
            "response_tokens": min(len(s.response_ids) for s in samples)}
