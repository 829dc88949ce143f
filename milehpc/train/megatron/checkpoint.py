"""Distributed checkpoints of the Megatron trainer (model + optimizer) with ``megatron.core.dist_checkpointing``.

Every trainer rank writes its own shards into one shared directory; loading builds the sharded state dict of the
*current* model, so a checkpoint written at one TP/PP/DP layout resumes at another (e.g. TP1 -> TP2): resharding.
The distributed optimizer is saved ``fully_reshardable``.

Upstream work-arounds (megatron-core 0.16 without TE/Apex: CPU, and GPUs without TE) applied in :func:`load`:

* ``KeyError: 'step'`` / ``assert len(steps) == 1`` loading the distributed optimizer into a fresh one: Adam has
  no state yet, so we run one zero-gradient, zero-lr step first to create every state tensor (``step`` included),
  which the loaded values then overwrite.
* the optimizer state's per-parameter ``step`` tensors come back as one shared tensor: each is replaced by its own
  copy after loading so later in-place increments stay per-parameter.

milehpc's checkpoint directory: :meth:`MegatronTrainer.state_dict_for_checkpoint` writes ``<checkpoint dir>/
megatron/v<version>`` here (collectively) when the trainer knows the checkpoint root, and its small per-rank state
references that directory; the manifest is committed by :class:`milehpc.checkpoint.Checkpointer` only
after every rank has written, so a half-written one is never referenced.

Resuming at another layout: the "megatron" trainer plugin registers :func:`can_reshard` as its ``can_reshard``, so
:class:`milehpc.checkpoint.Checkpointer` (ranks) and ``milehpc submit --resume RUN_DIR --set trainer.tp=N``
(login node) accept a checkpoint whose trainer TP/PP/DP differ; every new trainer rank then takes trainer rank 0's
small state (it names the dist checkpoint) and :func:`load` reshards model and optimizer (see LoopCheckpoint for
what else carries over). Rows of the TP vocabulary padding that the old layout did not have are zero-filled by
Megatron (``allow_shape_mismatch`` of the embedding/output layer); they are masked out of every logprob.

A critic (PPO/GAE, :mod:`.critic`) is saved beside the policy as ``critic`` / ``critic_optimizer``, its keys
prefixed ``critic.`` so they do not collide with the policy's; it reshards the same way.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol

META = {"distrib_optim_sharding_type": "fully_reshardable"}
PARALLEL_KEYS = ("world_size", "trainer_ranks", "tp", "pp", "dp")


class CheckpointedTrainer(Protocol):
    """What this module uses of :class:`milehpc.train.megatron.trainer.MegatronTrainer` (which imports this module,
    so it is described here rather than imported)."""

    module: Any  # the Megatron GPT model: sharded_state_dict(), load_state_dict()
    ddp: Any  # its DistributedDataParallel wrapper: zero_grad_buffer(), parameters()
    optimizer: Any  # the (distributed, maybe chained) Megatron optimizer
    critic: Any  # None, or a MegatronCritic: module, ddp, optimizer as above
    version: int  # weight version
    steps: int  # optimizer steps taken


def _trained(trainer: CheckpointedTrainer) -> list[tuple[str, str, Any]]:
    """(state key, sharded key prefix, holder of module/ddp/optimizer) of every trained model: policy, critic."""
    parts: list[tuple[str, str, Any]] = [("model", "", trainer)]
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        parts.append(("critic", "critic.", critic))
    return parts


def _sharded(trainer: CheckpointedTrainer, *, loading: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, prefix, part in _trained(trainer):
        model_sd = part.module.sharded_state_dict(prefix=prefix)
        out[key] = model_sd
        opt_key = "optimizer" if key == "model" else f"{key}_optimizer"
        out[opt_key] = part.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=META)
    return out


def save(trainer: CheckpointedTrainer, directory: str | Path) -> Path:
    """Collective over the trainer ranks: write model and optimizer shards into ``directory`` (created)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if getattr(trainer, "adapters", None):  # its sharded state dict would hold the frozen base, and no adapter layout
        raise RuntimeError("a LoRA trainer's checkpoint is adapter-only: MegatronTrainer.state_dict_for_checkpoint")
    path = Path(directory)
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    state = _sharded(trainer, loading=False)
    state["meta"] = {"version": trainer.version, "steps": trainer.steps}
    dist_checkpointing.save(state, str(path), validate_access_integrity=False)
    dist.barrier()
    return path


def _materialise_optimizer_state(trainer: Any) -> None:
    """Create Adam's state (exp_avg, exp_avg_sq, step) with a step that changes nothing (grads 0, lr 0)."""
    groups = trainer.optimizer.param_groups
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in groups]
    for g in groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    trainer.ddp.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    for p in trainer.ddp.parameters():
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
    trainer.optimizer.step()
    for g, (lr, wd) in zip(groups, saved, strict=True):
        g["lr"], g["weight_decay"] = lr, wd


def _unshare_steps(trainer: Any) -> None:
    """Give every parameter its own ``step`` tensor (the loaded state shares one)."""
    import torch

    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for st in inner.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()


def load(trainer: CheckpointedTrainer, directory: str | Path) -> dict[str, Any]:
    """Collective: load model and optimizer from ``directory`` into ``trainer`` at its current layout."""
    from megatron.core import dist_checkpointing

    parts = _trained(trainer)
    for _, _, part in parts:
        _materialise_optimizer_state(part)
    sharded = _sharded(trainer, loading=True)
    sharded["meta"] = {"version": 0, "steps": 0}
    state = dist_checkpointing.load(sharded, str(directory))
    for key, prefix, part in parts:
        part.module.load_state_dict({k.removeprefix(prefix): v for k, v in state[key].items()}, strict=False)
        part.optimizer.load_state_dict(state["optimizer" if key == "model" else f"{key}_optimizer"])
        _unshare_steps(part)
    meta = state.get("meta") or {}
    trainer.version, trainer.steps = int(meta.get("version", 0)), int(meta.get("steps", 0))
    return meta


def can_reshard(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """For :class:`milehpc.checkpoint.Checkpointer`: a Megatron checkpoint resumes at any TP/PP/DP layout
    of the same model (only the trainer's parallel sizes may differ)."""
    if saved.get("trainer_backend") != "megatron" or current.get("trainer_backend") != "megatron":
        return False
    other = {k for k in set(saved) | set(current) if saved.get(k) != current.get(k)}
    return other <= set(PARALLEL_KEYS)


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` ``v<version>`` directories under ``root`` (rank 0 only)."""
    root = Path(root)
    if not root.is_dir():
        return
    dirs = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit()),
                  key=lambda p: int(p.name[1:]))
    for p in dirs[:-keep] if keep > 0 else dirs:
        shutil.rmtree(p, ignore_errors=True)
