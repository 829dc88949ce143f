#!/bin/bash
# Flake hunt (not part of CI's default run): run chosen tests N times under CPU load and count, per test, how
# often it passed, failed or skipped. The load is one busy loop per core (or -l N), started here and stopped on
# any exit (the trap kills exactly the PIDs this script started).
#
#   scripts/stress.sh [-n REPS] [-l LOOPS] [TEST ...]      default tests: the MPI, Slurm and checkpoint tests
#   scripts/stress.sh -n 5 -l 2 tests/test_runtime_mpi.py
#   PYTEST_ADDOPTS='-k crashing' scripts/stress.sh -n 10 tests/test_runtime_mpi.py
#
# Exit status: 0 when no test failed in any repetition, 1 otherwise, 2 on bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/stress.sh [-n REPS] [-l LOOPS] [TEST ...]" >&2; exit 2; }
is_count() { [[ "$1" =~ ^[0-9]+$ ]]; }

reps=5
loops=$(nproc)
while getopts "n:l:h" opt; do
    case "$opt" in
        n) is_count "$OPTARG" && [ "$OPTARG" -ge 1 ] || { echo "stress.sh: -n: expected a count >= 1, got '$OPTARG'" >&2; exit 2; }
           reps=$OPTARG ;;
        l) is_count "$OPTARG" || { echo "stress.sh: -l: expected a count >= 0, got '$OPTARG'" >&2; exit 2; }
           loops=$OPTARG ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))
if [ "$#" -eq 0 ]; then
    set -- tests/test_runtime_mpi.py tests/test_loop_mpi.py tests/test_ckpt_*.py tests/test_slurm_*.py
fi
for t in "$@"; do
    [ -e "${t%%::*}" ] || { echo "stress.sh: no such test file: $t" >&2; exit 2; }
done

python=.venv/bin/python
[ -x "$python" ] || python=python3
out=$(mktemp -d "${TMPDIR:-/tmp}/milehpc-stress.XXXXXX")

busy=()
stop_load() {
    local pid
    for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${busy[@]}"; do wait "$pid" 2>/dev/null; done
    busy=()
}
trap stop_load EXIT
trap 'exit 130' INT TERM  # the EXIT trap then stops the load
for _ in $(seq 1 "$loops"); do
    ( trap - INT TERM; while :; do :; done ) &
    busy+=("$!")
done
echo "stress.sh: $reps repetition(s) of $* under $loops busy loop(s) on $(nproc) core(s); reports in $out" >&2

for i in $(seq 1 "$reps"); do
    echo "stress.sh: repetition $i of $reps" >&2
    "$python" -m pytest -q -ra -p no:cacheprovider --junitxml="$out/rep-$i.xml" "$@" >"$out/rep-$i.log" 2>&1
    tail -n 1 "$out/rep-$i.log" >&2
done
stop_load

"$python" - "$out" "$reps" "$loops" "$@" <<'EOF'
"""Per-test counts over the repetitions' JUnit reports, then one summary line."""
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

out, reps, loops, tests = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
counts: dict[str, Counter] = defaultdict(Counter)
missing = 0
for i in range(1, reps + 1):
    report = out / f"rep-{i}.xml"
    if not report.exists():  # pytest itself failed (collection error, crash): count the repetition as failed
        missing += 1
        continue
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[name]["failed" if kind in ("failure", "error") else kind] += 1
width = max((len(n) for n in counts), default=10)
print(f"{'test':<{width}}  passed failed skipped")
for name in sorted(counts):
    c = counts[name]
    flag = "  <-- FAILED" if c["failed"] else ""
    print(f"{name:<{width}}  {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7}{flag}")
total = Counter()
for c in counts.values():
    total.update(c)
flaky = sorted(n for n, c in counts.items() if c["failed"])
print(f"stress: {len(counts)} tests x {reps} repetitions under {loops} busy loops: {total['passed']} passed, "
      f"{total['failed']} failed, {total['skipped']} skipped, {missing} repetitions without a report"
      + (f"; failing: {', '.join(flaky)}" if flaky else ""))
sys.exit(1 if total["failed"] or missing else 0)
EOF
