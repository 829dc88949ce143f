"""Megatron-core's real per-rank footprint at TP=2 on the CPU, against milehpc.memory's estimate (issue 20):

    mpirun -np 2 python tests/memory_mpi_checks.py OUT.json

For each layout (fp32 and bf16 parameters; with and without the distributed optimizer) rank 0 writes the measured
bytes of this rank's parameters, gradient buffers, optimizer state (Adam moments, step counters, fp32 master copies
that are not views of the parameters) and the estimate's items; tests/test_memory.py compares them. Then each rank
measures the peak resident memory of a CPU trainer rank and a reference-engine rank at one of
memory_measure.PEAK_SIZES (rank r: size r, side by side), which the test compares with the estimate's totals."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

from megatron_checks import V, _free_port, _job, _samples
from memory_measure import PEAK_SIZES, WARM_UP, measure_peaks, optimizer_bytes, tensor_bytes

DEMO = Path(__file__).resolve().parents[1] / "examples" / "cpu-demo.toml"
LAYOUTS = {
    "tp2_fp32": {"tp": 2},
    "tp2_bf16_distopt": {"tp": 2, "precision": "bf16", "distributed_optimizer": True},
}


def _leaves(opt: Any) -> list[Any]:
    return [leaf for o in getattr(opt, "chained_optimizers", [opt]) for leaf in [o]]


def megatron_optimizer_bytes(opt: Any, params: list[Any]) -> int:
    """Adam's state plus the fp32 master copies a Megatron optimizer keeps beside bf16 parameters."""
    own = {p.untyped_storage().data_ptr() for p in params}
    total = 0
    for o in _leaves(opt):
        total += optimizer_bytes(o.optimizer)
        seen: set[tuple[int, int]] = set()
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(o, attr, None) or []:
                for t in group:
                    key = (t.untyped_storage().data_ptr(), t.storage_offset())
                    if t.untyped_storage().data_ptr() not in own and key not in seen:
                        seen.add(key)
                        total += t.numel() * t.element_size()
    return total


def measure(layout: dict[str, Any]) -> dict[str, Any]:
    from milehpc.memory import estimate_trainer_bytes
    from milehpc.train.megatron.trainer import MegatronTrainer

    job = _job(**layout)
    tr = MegatronTrainer(job, pad_id=0, vocab_size=V)
    tr.train_step(_samples(5), 0)
    params = list(tr.module.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in tr.ddp.buffers)
    got = {"params": tensor_bytes(params), "grads": grads,
           "optimizer": megatron_optimizer_bytes(tr.optimizer, params)}
    return {"measured": got, "estimated": estimate_trainer_bytes(job, vocab_size=V)}


def main() -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    results = {name: measure(layout) for name, layout in LAYOUTS.items()}
    dist.destroy_process_group()  # the peaks are of one rank alone (a torch trainer wraps itself in DDP otherwise)
    from milehpc.config.load import load_job

    measure_peaks(load_job(DEMO, WARM_UP))
    sets = PEAK_SIZES[comm.Get_rank() % len(PEAK_SIZES)]
    results["peaks"] = {"sets": list(sets), "measured": measure_peaks(load_job(DEMO, sets))}
    every = comm.gather(results, root=0)
    if comm.Get_rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump({"ranks": every}, f, indent=1)


if __name__ == "__main__":
    main()
