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
