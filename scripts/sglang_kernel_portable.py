"""Rewrite the vendored CPU kernel's csrc/cpu/CMakeLists.txt (in a writable copy) for x86 CPUs without AVX-512.

The upstream file compiles every x86 source with ``-march=x86-64-v4 -mavx512bf16 -mamx-*``, which runs only on
AVX-512 machines. Its sources already carry plain code paths for other CPUs (``CPU_CAPABILITY_AVX512`` is off
without those flags) and a switch that leaves out the AVX-512/AMX-only ops (the one its Arm build uses); this turns
both on for x86 with ``-march=x86-64-v3`` (AVX2). Called by scripts/setup-sglang-cpu.sh."""

from __future__ import annotations

import sys
from pathlib import Path


def make_portable(text: str) -> str:
    skip = 'if(CMAKE_SYSTEM_PROCESSOR MATCHES "aarch64|arm64")\n    add_compile_definitions(SGLANG_CPU_ARM64_SKIP'
    flags = 'if(MY_ARCH_DIR STREQUAL "x86_64")\n    add_compile_options('
    if skip not in text or flags not in text:
        raise SystemExit("sglang_kernel_portable: the kernel's CMakeLists.txt changed; update this script")
    text = text.replace(skip, skip.replace('MATCHES "aarch64|arm64"', 'MATCHES "aarch64|arm64|x86_64|AMD64"'))
    return text.replace(flags, 'if(MY_ARCH_DIR STREQUAL "x86_64")\n    add_compile_options(-O3 -Wno-unknown-pragmas '
                               '-march=x86-64-v3 -fopenmp)\nelseif(FALSE)\n    add_compile_options(')


# Four ops stay registered unconditionally in torch_extension_cpu.cpp; the Arm build defines them in aarch64/ (NEON),
# the x86 ones are AVX-512 only. Without a definition the library does not load (undefined symbol), so the AVX2 build
# gets stubs that refuse at call time (int8 GEMM and the fused MoE: not on the dense bf16/fp32 path).
STUBS = """#include <ATen/ATen.h>
#include <optional>
#include <string>
#include <tuple>
#include <vector>
#define MILEHPC_NO(op) TORCH_CHECK(false, op " needs the AVX-512 build of the sglang CPU kernel")
std::tuple<at::Tensor, at::Tensor> per_token_quant_int8_cpu(at::Tensor&) { MILEHPC_NO("per_token_quant_int8_cpu"); }
at::Tensor int8_scaled_mm_cpu(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const std::optional<at::Tensor>&,
                              at::ScalarType, bool) { MILEHPC_NO("int8_scaled_mm_cpu"); }
at::Tensor int8_scaled_mm_with_quant(at::Tensor&, at::Tensor&, at::Tensor&, const std::optional<at::Tensor>&,
                                     at::ScalarType, bool) { MILEHPC_NO("int8_scaled_mm_with_quant"); }
at::Tensor fused_experts_cpu(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, bool, int64_t,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<std::vector<int64_t>>, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<double>&, const std::optional<double>&, bool,
    const std::optional<std::string>&) { MILEHPC_NO("fused_experts_cpu"); }
"""


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.write_text(make_portable(path.read_text()))
    (path.parent / "milehpc_portable_stubs.cpp").write_text(STUBS)  # picked up by the build's GLOB_RECURSE
