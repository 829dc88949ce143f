#!/bin/bash
# The real sglang engine on the CPU, in the project venv (called by scripts/setup.sh; recipe and facts in
# ../shared/notes/sglang-on-cpu.md):
#   1. sglang==0.5.23 and the light packages it imports, all --no-deps (its own dependency set pulls CUDA packages);
#      the venv's torch (CPU), numpy and transformers stay (sglang 0.5.23 ran with them in the contract tests);
#   2. the CPU kernel library (sgl_kernel), built from a writable copy of ../shared/vendor/sglang-kernel-cpu/ once per
#      machine and cached under ~/.cache/milehpc/sgl-kernel/ keyed by the source hash, torch, Python and CPU variant;
#   3. the start-up hook (scripts/sglang_cpu_hook.py): the torchvision op schemas (the index's torchvision is a CUDA
#      build whose ops do not load on a CPU torch), and SGLang's AMX path turned off for CPU engines (its kernels
#      take bf16/fp16 only and no weight updates; milehpc asks for it through MILEHPC_SGLANG_CPU_NO_AMX).
# Where the vendored source is absent or the CPU cannot run the kernel, it says so and exits 0: the tests that need
# the real engine then skip saying why (or fail under MILEHPC_REQUIRE_ALL=1, as in CI).
#
#   --build-only   only step 2's build into the cache (nothing installed into the venv but the build tools, and those
#                  only when missing): scripts/setup-tests.sh runs it in the background while its downloads run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VENDOR="${MILEHPC_SGL_KERNEL_SRC:-../shared/vendor/sglang-kernel-cpu}"
CACHE="${MILEHPC_CACHE:-$HOME/.cache/milehpc}/sgl-kernel"
build_only=0
[ "${1:-}" = "--build-only" ] && build_only=1

install_engine() {  # step 1 and 3
    "$PY" -m pip install -q --no-deps -r scripts/sglang-cpu-requirements.txt
    SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp scripts/sglang_cpu_hook.py "$SITE/_milehpc_sglang_cpu_hook.py"
    echo "import _milehpc_sglang_cpu_hook" > "$SITE/_milehpc_sglang_cpu_hook.pth"
}

if [ ! -f "$VENDOR/pyproject.toml" ]; then
    [ "$build_only" -eq 1 ] || install_engine
    echo "setup-sglang-cpu: no kernel source at $VENDOR; the real-engine tests will skip (saying why)" >&2
    exit 0
fi
flags="$(grep -m1 '^flags' /proc/cpuinfo || true)"
if [[ " $flags " == *" avx512f "* ]]; then
    variant=avx512  # the upstream flags (-march=x86-64-v4 -mavx512bf16 ...; AMX is detected at run time)
elif [[ " $flags " == *" avx2 "* ]]; then
    # No AVX-512 (e.g. some EPYC VMs): the kernel's own non-AVX-512 code paths (the ones its Arm build uses), with
    # the AVX-512/AMX-only ops (int4/int8/fp8 MoE and GEMMs, fused QKV) left out; the Qwen2 path needs none of them.
    variant="avx2-$(sha256sum scripts/sglang_kernel_portable.py | cut -c1-8)"  # rebuilt when the stubs change
else
    echo "setup-sglang-cpu: this CPU has neither AVX-512 nor AVX2; the real-engine tests will skip" >&2
    [ "$build_only" -eq 1 ] || install_engine
    exit 0
fi
key="$( (cd "$VENDOR" && find . -type f ! -path './build/*' -print0 | sort -z | xargs -0 sha256sum) \
        | sha256sum | cut -c1-16)"
key="$key-$variant-$("$PY" -c 'import sys, torch; print(f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}")')"
wheel_dir="$CACHE/$key"
if ! ls "$wheel_dir"/sglang_kernel_cpu-*.whl >/dev/null 2>&1; then
    echo "setup-sglang-cpu: building the CPU kernel ($key; a few minutes, once per machine)"
    if ! "$PY" -c "import scikit_build_core, pathspec" 2>/dev/null; then
        "$PY" -m pip install -q --no-deps "scikit-build-core==1.1.2" "pathspec==1.1.1"
    fi
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    cp -r "$VENDOR" "$work/src" && chmod -R u+w "$work/src"
    if [ "$variant" != avx512 ]; then
        "$PY" scripts/sglang_kernel_portable.py "$work/src/csrc/cpu/CMakeLists.txt"
    fi
    (cd "$work/src" && CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$OLDPWD/$PY" -m pip wheel -q --no-build-isolation \
        --no-deps -w "$work/dist" .)
    mkdir -p "$wheel_dir.tmp" && cp "$work"/dist/sglang_kernel_cpu-*.whl "$wheel_dir.tmp/"
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"  # atomic: a half-built cache entry is never used
fi
[ "$build_only" -eq 1 ] && exit 0
install_engine
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/sglang_kernel_cpu-*.whl
echo "$variant" > "$SITE/_milehpc_sgl_kernel_variant.txt"
echo "setup-sglang-cpu: sglang $("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))'), kernel $key"
