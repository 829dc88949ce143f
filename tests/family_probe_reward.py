"""A reward for tests/test_container_binds.py that also loads every family's saved folder on the rank that scores
(the rollout rank, inside the Apptainer stand-in, after the rank's own tokenizer and policy loaded): each folder
through milehpc.models.build_model, the ranks' loader with its import trimming, and its logits on fixed ids written
to RUN_DIR/family-logits.pt. The test copies this file outside the repository (the container's image does not hold
the tests), so it imports only through the bind milehpc adds for a ``module:function`` reward on the job's
PYTHONPATH."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

PROBE_IDS = [[3, 5, 7, 11, 13, 17, 19, 23, 29]]
_done: list[bool] = []


def score(sample: Any, folders: dict[str, str]) -> float:
    if not _done:
        _done.append(True)
        run_dir = Path(os.environ["MILEHPC_RUN_DIR"])
        try:
            _probe(folders, run_dir / "family-logits.pt")
        except Exception:  # a failed reward only marks the sample: keep the cause for the test's message
            (run_dir / "family-probe-error.txt").write_text(traceback.format_exc())
            raise
    return (sum(sample.response_ids) % 5) / 4.0


def _probe(folders: dict[str, str], out_file: Path) -> None:
    import torch

    from milehpc.config.job import ModelSpec
    from milehpc.models import build_model

    ids = torch.tensor(PROBE_IDS)
    out = {}
    for kind, folder in folders.items():
        model = build_model(ModelSpec(path=folder), 0).eval()
        with torch.no_grad():
            out[kind] = {"class": type(model).__name__, "logits": model(input_ids=ids).logits}
    torch.save(out, out_file)
