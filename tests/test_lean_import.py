"""A CPU rank builds its model without the packages transformers imports for what a text model never runs
(milehpc.models.LEAN_HIDDEN: scipy, torchvision, triton; ~115 MiB of RSS per rank), and they are importable again
afterwards (a reward may use scipy). One fresh interpreter: the test process has imported them already."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from required import unavailable

from milehpc.models import LEAN_HIDDEN

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib, json, sys
# As a rank that loads a tokenizer folder before its model: transformers' and torch's probes have already found the
# packages installed (issue 32: the model's import then took the branch into a hidden package and failed).
import transformers.utils.import_utils as probes
assert probes.is_scipy_available() and probes.is_torchvision_available()
from milehpc.config.load import load_job
from milehpc.models import LEAN_HIDDEN, build_model, save_model

job = load_job(sys.argv[1])
model = build_model(job.model, 61)  # the random-init path
loaded_after_build = [n for n in LEAN_HIDDEN if n in sys.modules]
save_model(model, sys.argv[2])
job = load_job(sys.argv[1], [f"model.path={json.dumps(sys.argv[2])}"])
build_model(job.model, 61)  # the HF-folder path
loaded = [n for n in LEAN_HIDDEN if n in sys.modules]
left = [n for n in LEAN_HIDDEN if n in sys.modules and sys.modules[n] is None]
importable = [n for n in json.loads(sys.argv[3]) if importlib.import_module(n) is not None]
print(json.dumps({"after_build": loaded_after_build, "after_load": loaded, "left": left,
                  "importable": importable}))
"""


def test_a_cpu_rank_builds_and_loads_its_model_without_the_unused_packages(tmp_path: Path) -> None:
    installed = [n for n in LEAN_HIDDEN if importlib.util.find_spec(n) is not None]
    if not installed:
        unavailable(f"none of {LEAN_HIDDEN} is installed: nothing to leave out")
    proc = subprocess.run([sys.executable, "-c", CHECK, str(ROOT / "examples" / "cpu-demo.toml"),
                           str(tmp_path / "model"), json.dumps(installed)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"after_build": [], "after_load": [], "left": [], "importable": installed}
