"""Login-node latency: median wall time of `milehpc submit --dry-run` against `python -c pass`, same run.

Also proves that the dry run imports none of the heavy modules (torch, mpi4py, sglang, megatron, ...).
Usage: python bench/cli_startup.py [--repeat 15] [--site frontier-like] [--job examples/frontier-grpo.toml]
       [--set KEY=VALUE ...]  (the default job's Lustre inputs become stand-ins made here, tests/example_inputs.py)
Target: <= 0.3 s on a login node. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("torch", "mpi4py", "sglang", "megatron", "transformer_engine", "transformers", "h5py", "numpy",
         "tensorboard")
ROOT = Path(__file__).resolve().parent.parent


def _median(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--site", default="frontier-like")
    parser.add_argument("--job", default="examples/frontier-grpo.toml")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    sets = args.sets
    if args.job == "examples/frontier-grpo.toml" and not sets:
        # The login node checks the example's Lustre inputs: point them at stand-ins, as the tests do.
        sys.path.insert(0, str(ROOT / "tests"))
        from example_inputs import frontier_sets

        sets = list(frontier_sets())
    submit = [sys.executable, "-m", "milehpc", "submit", args.job, "--site", args.site, "--dry-run",
              *(a for s in sets for a in ("--set", s))]
    _median(submit, 2)  # warm the page cache and __pycache__
    baseline = _median([sys.executable, "-c", "pass"], args.repeat)
    dry_run = _median(submit, args.repeat)
    probe = (
        "import sys, json\n"
        "from milehpc.cli import cli\n"
        f"try:\n    cli.main({[*submit[3:]]!r}, standalone_mode=False)\n"
        "except SystemExit:\n    pass\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    heavy = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"python -c pass        median {baseline * 1000:7.1f} ms")
    print(f"milehpc submit --dry-run median {dry_run * 1000:7.1f} ms  ({args.site}, {args.job})")
    print(f"heavy modules imported by the dry run: {heavy or 'none'}")
    print(json.dumps({"dry_run_s": round(dry_run, 4), "python_pass_s": round(baseline, 4),
                      "ratio": round(dry_run / baseline, 2), "milehpc_overhead_s": round(dry_run - baseline, 4),
                      "target_s": 0.3, "within_target": dry_run <= 0.3, "heavy_modules": heavy}))


if __name__ == "__main__":
    main()
