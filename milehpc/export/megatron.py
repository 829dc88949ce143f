"""A Megatron run's weights read offline: its dist checkpoint (written at any TP/PP/DP/EP) loaded into one
process's GPT model at TP = PP = EP = 1 (``dist_checkpointing`` reshards on load, as a resume at another layout does),
then converted to HF names by the trainer's own converter (:mod:`milehpc.train.megatron.convert`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from milehpc.export.source import Source


def dist_checkpoint_dir(source: Source) -> Path:
    """The dist checkpoint trainer rank 0's state names; found under the run's checkpoint folder when the run dir
    was moved after training (the state holds the absolute path it was written at)."""
    recorded = source.trainer.get("dist_checkpoint")
    if recorded is None:
        raise ConfigError("this Megatron checkpoint holds per-rank shards only (written without a checkpoint "
                          "directory); export needs its dist checkpoint (runs launched by milehpc write one)",
                          file=str(source.info.path))
    path = Path(recorded)
    if not path.is_dir():
        path = source.info.path.parent / "megatron" / path.name
    if not (path / "metadata.json").is_file():
        raise ConfigError(f"expected the dist checkpoint {recorded} (or {path}) that step {source.info.step} "
                          "references, got none", file=str(source.info.path))
    return path


def megatron_weights(source: Source, hf_config: Any) -> dict[str, torch.Tensor]:
    """The policy of ``source`` in HF names and (transformers') layouts, loaded in this process alone."""
    import torch.distributed as dist

    path = dist_checkpoint_dir(source)
    own_group = not dist.is_initialized()
    if own_group:  # a world of one: Megatron's parallel state needs a process group even at TP = PP = 1
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("megatron export runs in one process; torch.distributed already has "
                           f"{dist.get_world_size()} ranks")
    try:
        return _load(source, hf_config, path)
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def _load(source: Source, hf_config: Any, path: Path) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    from milehpc.train.megatron import convert
    from milehpc.train.megatron import model as mm
    from milehpc.train.megatron.trainer import init_parallel

    job = source.job
    one = dataclasses.replace(job.trainer, tp=1, pp=1, dp=1, ep=1)
    arch = mm.arch_of(hf_config)
    init_parallel(1, 1, 1, timeout_s=job.resources.collective_timeout_s, seed=job.run.seed, moe=arch.is_moe)
    # The local layer spec reads a transformer-engine checkpoint too (Megatron maps the fused-norm names).
    module = mm.build_gpt(arch, mm.transformer_config(arch, one, use_cpu_initialization=True), tp=1, te=False)
    # The model alone: the optimizer state (as large again, or more) is not read.
    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, str(path))
    result = module.load_state_dict(loaded["model"], strict=False)
    bad = [k for k in result.missing_keys if not k.endswith("_extra_state")] + list(result.unexpected_keys)
    if bad:
        raise ConfigError(f"the dist checkpoint does not fit the job's model: {bad[:5]}", file=str(path))
    named = [(name, p.detach()) for name, p in module.named_parameters()]
    return {name: t.contiguous() for name, t in convert.to_hf(named, arch)}
