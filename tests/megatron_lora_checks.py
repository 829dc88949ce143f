"""Megatron LoRA against the torch trainer's peft LoRA, as ONE launch (importing megatron takes seconds):

    mpirun -np 2 python tests/megatron_lora_checks.py OUT.json WORK_DIR

Rank 0 writes the figures to OUT.json; tests/test_megatron_lora.py asserts on them. On 2 ranks at TP=2, Qwen2 (qkv
bias; GQA, 2 query groups of 2 heads per TP rank) with a vocabulary that TP pads:

* ``default`` — the default target modules (q/k/v/o, gate/up/down): both trainers start from the same adapter
  (peft's draws with the run's seed; compared), then B is set to the same nonzero values in both, and one GRPO step
  on the same batch gives the same loss and every adapter gradient (gathered to full shape, HF names); the frozen
  base is untouched and out of the optimizer; the sync carries the adapter alone. The adapter-only checkpoint
  (written with a dist checkpoint root set, which LoRA leaves unused) resumes bit-exactly at TP=2, is refused at
  another layout, and ``milehpc export``'s reader (:func:`milehpc.train.lora_export.policy_from_checkpoint`) loads
  it as the torch trainer's.
* ``subset`` — ``q_proj``, ``v_proj`` and ``down_proj`` only (k's slice of the fused qkv and all of fc1 without an
  adapter): the same loss and gradients.
"""

from __future__ import annotations

import json
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

from megatron_checks import _init_torch_distributed, _maxdiff, _parity_samples

V = 55  # the toy tokenizer's vocabulary (odd: TP=2 pads it); the export reader rebuilds the base with it
# GQA with 2 query groups per TP rank (2 q heads each): the per-group qkv interleaving is exercised at TP=2.
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 48}
TARGETS = {"default": None, "subset": ["q_proj", "v_proj", "down_proj"]}


def _job(targets: list[str] | None) -> Any:
    from milehpc.config.load import job_from_dict

    lora: dict[str, Any] = {"rank": 4, "alpha": 12.0}
    if targets is not None:
        lora["target_modules"] = targets
    return job_from_dict({"name": "mlora", "model": MODEL, "rollout": {"temperature": 0.8},
                          "algorithm": {"advantage": "grpo", "entropy_coef": 0.05},
                          "trainer": {"backend": "megatron", "tp": 2, "micro_batch_size": 2, "lr": 1e-2,
                                      "clip_grad": 0.0, "lora": lora}})


def _nonzero_b(initial: dict[str, Any]) -> dict[str, Any]:
    """The initial adapter with B drawn nonzero (the same on every rank), so every A gets a gradient at once."""
    import torch

    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(t.shape, generator=g) * 0.2 if ".lora_B." in n else t.clone() for n, t in initial.items()}


def _torch_step(job: Any, adapter: dict[str, Any]) -> dict[str, Any]:
    """The torch trainer (peft, one rank): its initial adapter, then one step from ``adapter``: loss and gradients."""
    import torch

    from milehpc.train import lora, torch_trainer

    with mock.patch.object(torch_trainer, "_dist", return_value=(0, 1)):
        tt = torch_trainer.TorchTrainer(job, types.SimpleNamespace(pad_id=0, eos_id=2, vocab_size=V))
        params = lora.trainable(tt.module)
        initial = {lora.engine_name(n): p.detach().clone() for n, p in params}
        with torch.no_grad():
            for n, p in params:
                p.copy_(adapter[lora.engine_name(n)])
        grads: dict[str, Any] = {}
        step = tt.optimizer.step

        def capture(*args: Any, **kwargs: Any) -> Any:
            grads.update({lora.engine_name(n): p.grad.detach().clone() for n, p in params})
            return step(*args, **kwargs)

        tt.optimizer.step = capture
        m = tt.train_step(_parity_samples(), 0)
    return {"initial": initial, "loss": m["train/loss"], "grad_norm": m["train/grad_norm"], "grads": grads,
            "entropy": m["train/actor/entropy"],
            "checkpoint_keys": sorted(lora.checkpoint_state(tt.module, source="", base_fingerprint="")["adapter"])}


def _bcast(comm: Any, obj: Any) -> Any:
    return comm.bcast(obj if comm.Get_rank() == 0 else None, root=0)


def _exported(comm: Any, tr: Any, *, grads: bool = False) -> dict[str, Any]:
    return _bcast(comm, dict(tr.export_weights(grads=grads)))


def check_targets(comm: Any, work: str, name: str) -> dict[str, Any]:
    from milehpc.train.megatron.trainer import MegatronTrainer

    job = _job(TARGETS[name])
    tr = MegatronTrainer(job, pad_id=0, vocab_size=V, eos_id=2)
    base = {n: p.detach().clone() for n, p in tr.module.named_parameters() if ".lora." not in n}
    initial = _exported(comm, tr)
    scaling = initial.pop("lora.scaling")
    adapter = _nonzero_b(initial)
    want = _bcast(comm, _torch_step(job, adapter) if comm.Get_rank() == 0 else None)
    for a in tr.adapters:
        a.load(adapter, tr.tp_rank)
    m = tr.train_step(_parity_samples(), 0)
    got = _exported(comm, tr, grads=True)
    out: dict[str, Any] = {
        "initial_vs_peft": _maxdiff(initial, want["initial"]),  # also: the same names
        "scaling": float(scaling),
        "adapter_tensors": len(initial),
        "loss_diff": abs(m["train/loss"] - want["loss"]),
        "torch_loss": want["loss"], "megatron_loss": m["train/loss"],
        "torch_entropy": want["entropy"],  # the entropy bonus makes the loss depend on the model at ratio 1
        "entropy_diff": abs(m["train/actor/entropy"] - want["entropy"]),
        "grad_norm_rel": abs(m["train/grad_norm"] / want["grad_norm"] - 1),
        "grads_maxdiff": _maxdiff(got, want["grads"]),
        "grads_max": max(float(g.abs().max()) for g in want["grads"].values()),
        # every adapter tensor has a live gradient (a missing slice would leave one at 0 in both trainers)
        "grads_min_of_max": min(float(g.abs().max()) for g in want["grads"].values()),
        "base_trainable": sum(p.requires_grad for n, p in tr.module.named_parameters() if ".lora." not in n),
        "base_moved": max(float((p.detach() - base[n]).abs().max())
                          for n, p in tr.module.named_parameters() if ".lora." not in n),
        "optimizer_params": sum(len(g["params"]) for g in tr.optimizer.param_groups),
        "local_adapter_params": sum(1 for n, _ in tr.module.named_parameters() if ".lora." in n),
        "sync_bytes": m.get("sync/bytes"), "full_model_bytes": m.get("sync/full_model_bytes"),
    }
    if name == "default":
        out.update(_checkpoint(comm, tr, job, work, want["checkpoint_keys"]))
    return out


def _checkpoint(comm: Any, tr: Any, job: Any, work: str, peft_keys: list[str]) -> dict[str, Any]:
    """The adapter-only checkpoint after one step: reloaded, the next step equals the uninterrupted one bit for bit;
    at another layout it is refused; ``milehpc export``'s reader gives the torch trainer's peft model with it."""
    import copy

    from milehpc.errors import ConfigError
    from milehpc.train import lora
    from milehpc.train.lora_export import policy_from_checkpoint
    from milehpc.train.megatron.trainer import MegatronTrainer

    root = Path(work) / "megatron"
    tr.dist_checkpoint_root = root  # as in a run: LoRA must not write a dist checkpoint (the base) there
    state = copy.deepcopy(tr.state_dict_for_checkpoint())
    saved = _exported(comm, tr)
    want = tr.train_step(_parity_samples(), 1)
    after = _exported(comm, tr)
    again = MegatronTrainer(job, pad_id=0, vocab_size=V, eos_id=2)
    again.load_checkpoint_state(state)
    out: dict[str, Any] = {"ckpt_reload_vs_saved": _maxdiff(saved, _exported(comm, again))}
    got = again.train_step(_parity_samples(), 1)
    out.update(ckpt_resume_loss_diff=abs(got["train/loss"] - want["train/loss"]),
               ckpt_resume_vs_uninterrupted=_maxdiff(after, _exported(comm, again)),
               ckpt_steps=[again.steps, again.version], ckpt_dist_dir_written=root.exists(),
               ckpt_model_keys=sorted(state["model"]), ckpt_adapter_is_peft=sorted(state["model"]["adapter"]) ==
               peft_keys, ckpt_optimizer_states=len(state["optimizer"]["state"]))
    try:
        again.load_checkpoint_state({**state, "lora_layout": [1, 1, 2]})
        out["ckpt_other_layout"] = ""
    except ConfigError as err:
        out["ckpt_other_layout"] = str(err)
    try:  # a checkpoint of a run without LoRA (no adapter layout) into this LoRA trainer
        again.load_checkpoint_state({k: v for k, v in state.items() if k != "lora_layout"})
        out["ckpt_without_lora"] = ""
    except ConfigError as err:
        out["ckpt_without_lora"] = str(err)
    if comm.Get_rank() == 0:
        policy = policy_from_checkpoint(job, state["model"])
        read = {lora.engine_name(n): p.detach() for n, p in lora.trainable(policy)}
        out["export_reader_vs_saved"] = _maxdiff({n: t for n, t in saved.items() if n != "lora.scaling"}, read)
    return _bcast(comm, out)


def main() -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from mpi4py import MPI

    out_path, work = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    _init_torch_distributed(comm)
    from milehpc.train.megatron import cpu_adapt

    cpu_adapt.apply()
    results: dict[str, Any] = {}
    for name in TARGETS:
        t0 = time.perf_counter()
        results[name] = check_targets(comm, work, name)
        results[name]["seconds"] = time.perf_counter() - t0
    if comm.Get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
