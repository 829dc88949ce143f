"""The job against its site partition's devices, on the login node (milehpc.config.rules.SITE_RULES): what the
partition's GPUs, or the container shipped for them, cannot run is refused before the job queues, in one line naming
the job file, the field and what was expected (exit code 2). Run through the real CLI (``milehpc plan``) on the
shipped site configs; the examples the sites ship must pass."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from example_inputs import frontier_sets

from milehpc.cli import cli

ROOT = Path(__file__).resolve().parents[1]
FRONTIER = ROOT / "examples" / "frontier-grpo.toml"


def _plan(job: Path, site: str, *sets: str) -> tuple[int, str]:
    args = ["plan", str(job), "--site", site, "--force"]
    for s in (*frontier_sets(), *sets):  # the example's Lustre inputs, made here
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    return res.exit_code, res.output


@pytest.mark.parametrize(("sets", "field", "expected"), [
    (("trainer.precision='fp8'",), "trainer.precision", "expected 'bf16' or 'fp32' on an AMD partition"),
    (("trainer.options.transformer_engine=true",), "trainer.options.transformer_engine",
     "expected false or unset on an AMD partition"),
    # colocated, the example's 32 ranks share 16 GCDs: 2 nodes (4 would leave two idle, refused first); SGLang (the
    # engine that pauses the trainer with torch_memory_saver) with an image of its own (the site's has none)
    (("resources.colocate=true", "run.loop='sync'", "resources.nodes=2", "rollout.engine='sglang'",
      "rollout.options={}", "site.containers.apptainer.engines=['sglang']"), "resources.colocate", "expected false on an AMD partition"),
])
def test_rocm_partition_refuses_what_its_container_cannot_run(sets: tuple[str, ...], field: str,
                                                              expected: str) -> None:
    code, out = _plan(FRONTIER, "frontier-like", *sets)
    line = out.strip().splitlines()[-1]
    assert code == 2, out
    assert line.startswith(f"milehpc: error: {FRONTIER} (with --set): {field}: {expected}"), line
    assert "containers/milehpc-rocm.def" in line


def test_rocm_partition_lets_the_reference_engine_colocate() -> None:
    """Only a colocated SGLang engine pauses the trainer with torch_memory_saver; the reference engine offloads
    nothing, so its colocated runs stay open on AMD."""
    code, out = _plan(FRONTIER, "frontier-like", "resources.colocate=true", "run.loop='sync'",
                      "rollout.engine='reference'", "rollout.options={}", "resources.nodes=2")
    assert code == 0, out


def test_frontier_example_plans_on_its_site() -> None:
    """The frontier example keeps the AMD rules: separate trainer and engines, bf16 on Megatron's local spec, and the
    engine its site's image holds (vLLM: containers/milehpc-rocm.def, tests/test_site_engines.py)."""
    code, out = _plan(FRONTIER, "frontier-like")
    assert code == 0, out


@pytest.mark.parametrize(("site", "nodes"), [("dgx-h100-like", 4), ("perlmutter-like", 8), ("frontier-like", 4)])
def test_mxfp8_needs_compute_capability_10_on_the_login_node(site: str, nodes: int) -> None:
    code, out = _plan(FRONTIER, site, "trainer.precision='fp8'", "trainer.fp8_recipe='mxfp8'",
                      "container.image=''", "site.access.account='A'", f"resources.nodes={nodes}")
    line = out.strip().splitlines()[-1]
    assert code == 2, out
    if site == "frontier-like":  # no transformer-engine at all there: the AMD rule speaks first
        assert ": trainer.precision: expected 'bf16' or 'fp32' on an AMD partition" in line
    else:
        arch = {"dgx-h100-like": "sm_90", "perlmutter-like": "sm_80"}[site]
        assert f": trainer.fp8_recipe: expected an fp8_recipe for devices.arch = '{arch}'" in line, line
        assert "compute capability >= 10.0" in line and line.endswith("got 'mxfp8'")


def test_mxfp8_passes_where_the_partition_is_sm_100() -> None:
    from milehpc.config.load import job_from_dict, load_site
    from milehpc.config.rules import check_site_rules

    job = job_from_dict({"name": "mx", "model": {"arch": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                                 "num_kv_heads": 2, "intermediate_size": 128, "dtype": "bfloat16"},
                         "trainer": {"backend": "megatron", "precision": "fp8", "fp8_recipe": "mxfp8"},
                         "site": {"devices": {"arch": "sm_100"}}}, file="mx.toml")
    _site, partition = load_site("dgx-h100-like", job, "mx.toml")
    assert partition.devices.arch == "sm_100"
    check_site_rules(job, partition, file="mx.toml")  # B200: allowed
    for recipe in ("delayed", "tensorwise", "blockwise"):  # Hopper runs these
        job.trainer.fp8_recipe = recipe
        partition.devices.arch = "sm_90"
        check_site_rules(job, partition, file="mx.toml")
