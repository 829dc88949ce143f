"""Checkpointing across 2 real MPI ranks: rank-keyed shards, one manifest; a shard damaged on rank 1 only makes
*both* ranks fall back to the previous checkpoint (agreed by allreduce); a rank whose write fails makes every rank
raise instead of waiting for a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

REPO = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.executable).parent / "mpirun"

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from mpi4py import MPI
    from pathlib import Path
    from milehpc.checkpoint import Checkpointer, MPICollective, list_checkpoints
    root, out = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    coll = MPICollective(comm, timeout_s=60)
    r = coll.rank
    res = {"size": coll.size}
    ck = Checkpointer(root, coll=coll, keep=3)
    for step in (1, 2):
        ck.save(step, {"w": torch.full((4,), float(10 * step + r))})
    if r == 1:  # damage rank 1's newest shard in place (same size)
        p = f"{root}/step-00000002/rank-00001.pt"
        b = bytearray(open(p, "rb").read()); b[len(b) // 2] ^= 0xFF; open(p, "wb").write(bytes(b))
    comm.Barrier()
    got = Checkpointer(root, coll=coll).resume()
    res["resumed_step"] = got.info.step
    res["w"] = got.state["w"].tolist()
    # rank 1 cannot write its shard (a state torch cannot serialise): everyone raises, nobody waits for a timeout
    try:
        ck.save(3, {"w": torch.zeros(1), "bad": (lambda: 0) if r == 1 else 0})
    except Exception as err:
        res["save3"] = f"{type(err).__name__}: {err}"
    res["after_failed_save"] = [c.step for c in list_checkpoints(Path(root))]
    json.dump(res, open(f"{out}/rank-{r}.json", "w"))
""")


def test_two_ranks_agree_on_fallback_and_failure(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(REPO)}
    root = tmp_path / "ckpt"
    proc = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-c",
                           SCRIPT, str(root), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [x["size"] for x in res] == [2, 2]  # one world of 2, not two worlds of 1
    assert [x["resumed_step"] for x in res] == [1, 1]  # rank 0's shard was fine, but step 2 is skipped by both
    assert res[0]["w"] == [10.0] * 4 and res[1]["w"] == [11.0] * 4  # each rank its own shard
    assert "rank 1" in res[0]["save3"] and "previous checkpoint is intact" in res[0]["save3"]
    assert "lambda" in res[1]["save3"] or "pickle" in res[1]["save3"].lower()  # its own error
    assert res[0]["after_failed_save"] == [2, 1]  # nothing half-done became a checkpoint
    manifest = json.loads((root / "step-00000002" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"rank-00000.pt", "rank-00001.pt"} and manifest["world_size"] == 2
