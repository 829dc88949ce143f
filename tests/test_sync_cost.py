"""Issue 33 item 4: the weight sync's cost on paper (milehpc.weights.cost) against the real thing: its tensors are the
torch trainer's exported ones (names, shapes, dtypes, bytes), its buckets are what the sync's own bucketing makes of
those real tensors, its seconds follow the site's figures, and ``milehpc plan`` and the README show it."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from family_models import save_tiny

from milehpc.cli import cli
from milehpc.config.load import job_from_dict
from milehpc.weights import cost

V = 29
SHAPE = {"hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48,
         "vocab_size": V}
TOKENIZER = types.SimpleNamespace(pad_id=0, eos_id=2, vocab_size=V)
REPO = Path(__file__).resolve().parent.parent
BUCKET = 4096  # small enough that the tiny models fill many buckets and send some tensors on their own (>= 4 KiB)


def _job(model: dict[str, object], engine: str = "reference", **trainer: object) -> object:
    return job_from_dict({"name": "sync-cost", "model": model, "rollout": {"engine": engine},
                          "trainer": {"micro_batch_size": 8, **trainer}})


def _exported(job: object) -> list[tuple[str, object]]:
    from milehpc.train.torch_trainer import TorchTrainer

    return list(TorchTrainer(job, TOKENIZER).export_weights())


CASES = {
    # Qwen2: QKV biases and tied embeddings (lm_head not sent: issue 33), fp32.
    "qwen2-tied-fp32": ({**SHAPE, "arch": "qwen2", "tie_word_embeddings": True}, "reference"),
    # Llama in bf16 (the dtype on the wire is the model's).
    "llama-bf16": ({**SHAPE, "arch": "llama", "dtype": "bfloat16"}, "reference"),
    # Qwen3-MoE for SGLang: the experts go one by one in the checkpoint names.
    "qwen3-moe-sglang": ({**SHAPE, "arch": "qwen3", "num_experts": 4, "moe_top_k": 2}, "sglang"),
    # Qwen2-MoE for the reference engine: stacked experts, the shared expert and its gate.
    "qwen2-moe-stacked": ({**SHAPE, "arch": "qwen2", "num_experts": 4, "moe_top_k": 2}, "reference"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_paper_tensors_are_the_torch_trainers_export(case: str) -> None:
    model, engine = CASES[case]
    job = _job(model, engine)
    real = _exported(job)
    paper = cost.job_tensors(job)
    assert [(t.name, t.shape, t.dtype, t.nbytes) for t in paper] == [
        (n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()) for n, t in real]
    _same_buckets(paper, real)


def test_a_checkpoint_folders_shape_is_the_one_costed(tmp_path: Path) -> None:
    """Qwen3 from a config.json: its head_dim (not hidden / heads) and q/k norms."""
    save_tiny("qwen3", tmp_path / "qwen3", V)
    job = _job({"path": str(tmp_path / "qwen3")})
    real = _exported(job)
    paper = cost.job_tensors(job)
    assert [(t.name, t.shape) for t in paper] == [(n, tuple(t.shape)) for n, t in real]
    assert sum(t.nbytes for t in paper) == sum(t.numel() * t.element_size() for _, t in real)


def _same_buckets(paper: list[cost.TensorSpec], real: list[tuple[str, object]]) -> None:
    """Both of the sync's bucketings, on the described tensors and on the real ones."""
    from milehpc.rollout import sglang_mapping
    from milehpc.weights.broadcast import plan_buckets

    ours = cost.bucket_sizes(paper, direct=False, bucket_bytes=BUCKET)
    theirs = [b.nbytes for b in plan_buckets(real, BUCKET)[1]]
    assert ours == theirs and len(ours) > 2
    ours = cost.bucket_sizes(paper, direct=True, bucket_bytes=BUCKET)
    theirs = [sum(t.numel() * t.element_size() for _, t in b) for b in sglang_mapping.buckets(real, BUCKET)]
    assert ours == theirs and len(ours) > 2


def test_stages_split_the_layers_as_megatron_does() -> None:
    """Stage s of pp holds layers [s L/pp, (s+1) L/pp), the embedding first, the final norm and lm_head last; the
    stages together are the model, each tensor once."""
    job = _job({**SHAPE, "arch": "llama"})
    tensors = cost.job_tensors(job)
    stages = [cost.stage_tensors(tensors, 4, 2, s) for s in range(2)]
    assert sorted(t.name for s in stages for t in s) == sorted(t.name for t in tensors)
    first, last = ({t.name for t in s} for s in stages)
    assert "model.embed_tokens.weight" in first and {"model.norm.weight", "lm_head.weight"} <= last
    assert all(f"layers.{i}." not in " ".join(last) for i in (0, 1))
    assert all(f"layers.{i}." not in " ".join(first) for i in (2, 3))


def test_seconds_are_the_bandwidth_term_plus_latency_per_bucket() -> None:
    """Two 3 MiB tensors in 4 MiB buckets: SGLang's bucketing sends two buckets. Across nodes the slower of the
    node's injection and the GPU link bounds the ring; inside one node the GPU link alone."""
    mib = 1 << 20
    tensors = [cost.TensorSpec(f"t{i}", (3 * mib // 2,), "bfloat16") for i in range(2)]
    fabric = cost.Fabric(node_bytes_s=100e9, gpu_link_bytes_s=400e9, latency_s=2e-6)
    across = cost.sync_cost([tensors], direct=True, members=9, nodes=2, fabric=fabric, bucket_bytes=4 * mib)
    assert across.buckets == 2 and across.bytes == 6 * mib and across.bandwidth == 100e9
    assert across.seconds == pytest.approx(6 * mib / 100e9 + 2 * 8 * 2e-6, rel=1e-12)
    inside = cost.sync_cost([tensors], direct=True, members=9, nodes=1, fabric=fabric, bucket_bytes=4 * mib)
    assert inside.bandwidth == 400e9
    assert inside.seconds == pytest.approx(6 * mib / 400e9 + 2 * 8 * 2e-6, rel=1e-12)
    # Stages follow one another: two stages take the sum of their times.
    two = cost.sync_cost([tensors, tensors], direct=True, members=9, nodes=2, fabric=fabric, bucket_bytes=4 * mib)
    assert two.seconds == pytest.approx(2 * across.seconds, rel=1e-12) and two.leader_bytes == 6 * mib
    assert cost.sync_cost([tensors], direct=True, members=9, nodes=2, fabric=None).seconds is None


def test_plan_shows_the_sync_estimate() -> None:
    """`milehpc plan`: one line, and the numbers in --json (bytes = the job's exported tensors; the seconds from the
    site's figures; a site without figures gives bytes and buckets only)."""
    demo = str(REPO / "examples" / "cpu-demo.toml")
    runner = CliRunner()
    out = runner.invoke(cli, ["plan", demo, "--site", "dgx-h100-like", "--json"])
    assert out.exit_code == 0, out.output
    sync = json.loads(out.output)["weight_sync"]
    from milehpc.config.load import load_job

    job = load_job(demo)
    assert sync["bytes"] == sum(t.nbytes for t in cost.job_tensors(job)) > 0
    # One node (1 trainer + 1 rollout rank): the H100's NVLink figure, 450 GB/s; one bucket of the small model.
    assert sync["bandwidth_bytes_s"] == 450e9 and sync["buckets"] == 1
    assert sync["seconds"] == pytest.approx(sync["bytes"] / 450e9 + 1 * 1 * 2e-6, rel=1e-9)
    text = runner.invoke(cli, ["plan", demo, "--site", "local"])
    assert text.exit_code == 0, text.output
    from milehpc.memory import size

    line = [x for x in text.output.splitlines() if x.startswith("weight sync per step:")]
    assert line == [f"weight sync per step: {size(sync['bytes'])} in 1 bucket(s) over 1 stage(s) to 1 rollout rank(s) "
                    "on 1 node(s), milehpc broadcast; no network figures: time not estimated"]


def test_the_readme_table_is_the_models_output() -> None:
    """The README's table is what ``python -m milehpc.weights.cost`` prints (figures from the shipped site files)."""
    rows = cost.paper_rows()
    lines = cost.table_lines(rows)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(lines) == 2 + 9 and all(line in readme for line in lines)
    # The bytes are the published parameter counts in bf16 (8.19B, 70.6B, 235.1B parameters).
    assert {r["model"]: round(r["gb"] / 2, 1) for r in rows} == {
        "8B (Qwen3-8B)": 8.2, "70B (Llama-3-70B)": 70.6, "235B-A22B MoE (Qwen3)": 235.1}
    assert all(math.isfinite(r["seconds"]) and r["seconds"] > r["gb"] / r["gb_s"] for r in rows)


def test_a_bad_interconnect_figure_is_one_line() -> None:
    """A site figure overridden by the job ([site] / --set) is validated like every other field: one line, exit 2."""
    out = CliRunner().invoke(cli, ["plan", str(REPO / "examples" / "cpu-demo.toml"), "--site", "dgx-h100-like",
                                   "--set", "site.interconnect.node_gb_s=-1"])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert out.output.strip().splitlines()[-1].endswith(
        "site.interconnect.node_gb_s: expected a value >= 0.001, got -1.0")


def test_what_a_stage_leader_holds_is_buckets_not_its_stage() -> None:
    """Issue 33: the export is sent as it is gathered, so a leader holds about three buckets, not its stage; more
    than the device holds is said."""
    import dataclasses

    from milehpc.config.load import load_site
    from milehpc.plan import make_plan

    job = job_from_dict({"name": "big", "model": {"hidden_size": 1024, "num_layers": 4, "num_heads": 8,
                                                  "num_kv_heads": 8, "intermediate_size": 2816, "vocab_size": 128000},
                         "trainer": {"pp": 2}})
    site, partition = load_site("dgx-h100-like")
    plan = make_plan(job, partition, site=site.name, partition_name="batch")
    for memory_gib, noted in ((0.5, True), (79.6, False)):
        part = dataclasses.replace(partition, devices=dataclasses.replace(partition.devices, memory_gib=memory_gib))
        sync = cost.for_job(job, plan, part)
        assert sync is not None and 0.5 * (1 << 30) < sync.leader_bytes < sync.bytes
        assert sync.held_bytes == 3 * max(st.largest_bucket for st in sync.stages)
        assert any("holds about three of its largest buckets" in n for n in sync.notes) == noted
