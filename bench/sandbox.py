"""Sandbox throughput: sandboxed executions per second on 2 cores (bubblewrap) against the same program run
unsandboxed (the ``none`` backend: same runner and rlimits, no namespaces), for a trivial program and for a typical
unit-test run (the ``code_tests`` harness: a one-line solution and four asserts); and the start-up overhead per call
(median sequential latency, sandboxed minus unsandboxed).

Usage: python bench/sandbox.py [--calls 200] [--cores 2]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from milehpc.rewards.code_harness import HARNESS  # noqa: E402
from milehpc.sandbox.bubblewrap import Bubblewrap  # noqa: E402
from milehpc.sandbox.choice import Pool  # noqa: E402
from milehpc.sandbox.types import Limits  # noqa: E402
from milehpc.sandbox.unsandboxed import Unsandboxed  # noqa: E402

LIMITS = Limits(wall_s=20, cpu_s=20)
# One interpreter on both sides (the host's PATH may start with a slow shim such as pyenv's).
PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"
TRIVIAL = ([PY, "prog.py"], {"prog.py": "pass\n"})
CASES = ["assert f([1,2,3])==6", "assert f([])==0", "assert f([5,-2])==3", "assert f([7])==7"]
UNIT_TEST = ([PY, "harness.py"], {
    "solution.py": "def f(a):return sum(a)\n", "harness.py": HARNESS,
    "cases.json": json.dumps({"nonce": "n", "timeout_s": 4.0,
                              "cases": [{"kind": "script", "code": c, "expected": None, "fn_name": ""} for c in CASES]})})


def _check(result: object, program: tuple) -> None:
    if not result.ok:  # type: ignore[attr-defined]
        raise SystemExit(f"bench: {program[0]} failed: {result.line()}")  # type: ignore[attr-defined]


def throughput(sandbox: object, program: tuple, calls: int, workers: int) -> float:
    pool = Pool(sandbox, workers)  # type: ignore[arg-type]
    argv, files = program
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as threads:
        for result in threads.map(lambda _: pool.run(argv, files=files, limits=LIMITS), range(calls)):
            _check(result, program)
    return calls / (time.perf_counter() - start)


def latency(sandbox: object, program: tuple, calls: int) -> float:
    argv, files = program
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        _check(sandbox.run(argv, files=files, limits=LIMITS), program)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[:args.cores]
    os.sched_setaffinity(0, cpus)  # the children inherit it
    sandboxed, plain = Bubblewrap(), Unsandboxed()
    for sb in (sandboxed, plain):  # warm the page cache
        latency(sb, TRIVIAL, 3)
    figures: dict[str, float] = {}
    for label, program in (("trivial", TRIVIAL), ("unit_test", UNIT_TEST)):
        # Interleaved halves in the order sandboxed, plain, plain, sandboxed: a steady drift of the machine's load
        # hits both sides alike.
        half = args.calls // 2
        box, raw = [], []
        for first, second in ((sandboxed, plain), (plain, sandboxed)):
            for sb in (first, second):
                (box if sb is sandboxed else raw).append(throughput(sb, program, half, len(cpus)))
        figures[f"{label}_sandboxed_per_s"] = round(statistics.mean(box), 1)
        figures[f"{label}_unsandboxed_per_s"] = round(statistics.mean(raw), 1)
        figures[f"{label}_ratio"] = round(statistics.mean(box) / statistics.mean(raw), 3)
        print(f"{label:9s}: {statistics.mean(box):7.1f} sandboxed/s vs {statistics.mean(raw):7.1f} unsandboxed/s "
              f"on {len(cpus)} cores (ratio {figures[f'{label}_ratio']:.2f})")
    box_lat, raw_lat = latency(sandboxed, TRIVIAL, 40), latency(plain, TRIVIAL, 40)
    figures.update(trivial_latency_sandboxed_ms=round(box_lat * 1000, 1),
                   trivial_latency_unsandboxed_ms=round(raw_lat * 1000, 1),
                   startup_overhead_ms=round((box_lat - raw_lat) * 1000, 1), cores=len(cpus), calls=args.calls)
    print(f"start-up overhead per call: {figures['startup_overhead_ms']:.1f} ms "
          f"(median {box_lat * 1000:.1f} ms sandboxed, {raw_lat * 1000:.1f} ms unsandboxed, sequential)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
