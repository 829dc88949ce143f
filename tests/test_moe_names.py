"""Issue 30, fault 8: an MoE model's experts reach SGLang under names its model classes load.

transformers 5 holds a layer's experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``); sglang
0.5.23's qwen3_moe / qwen2_moe / mixtral ``load_weights`` map experts only by per-expert checkpoint names (through
``FusedMoE.make_expert_params_mapping``) and skip every other name without a word. Checked against the real thing:
the installed sglang's model classes, built on one CPU process the way sglang's own layer tests build them
(``sglang.test.layer_ut_utils.init_single_process_dist``), load what both trainers export for an SGLang job through
their own ``load_weights`` (the code an engine's scheduler runs for ``update_weights_from_tensor`` and
``update_weights_from_distributed``): every exported name must reach a weight loader, every parameter of the model
must be written, and the fused experts must hold transformers' values. This file is also the script the check runs
in (a separate process: sglang's distributed set-up must not leak into the test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
V = 64
SHAPE = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0}
# family -> (transformers config class, its extra keys): every MoE family milehpc trains (milehpc.config.families)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", {"intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 16, "head_dim": 8}),
    "qwen2_moe": ("Qwen2MoeConfig", {"intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
SGLANG_CLASSES = {"qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"), "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
                  "mixtral": ("mixtral", "MixtralForCausalLM")}


def tiny_moe(family: str, seed: int = 0) -> Any:
    import torch
    import transformers

    cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**SHAPE, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


# ---- without sglang: the names against transformers' own checkpoint layout -----------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_layout_is_what_transformers_saves(family: str, tmp_path: Path) -> None:
    """The per-expert names and values :func:`milehpc.models.moe_names` gives are those transformers itself
    writes to a checkpoint (it reverts its stacked experts on save), which is what SGLang loads at start-up."""
    import torch
    from safetensors.torch import load_file

    from milehpc.models import engine_moe_layout, moe_names

    model = tiny_moe(family)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    layout = engine_moe_layout("sglang")
    ours = {n: t for name, tensor in model.state_dict().items()
            for n, t in moe_names(name, tensor, family, layout)}
    assert ours.keys() == saved.keys()
    assert all(torch.equal(ours[n], saved[n]) for n in saved)
    # The engines that run transformers' classes keep its in-memory names.
    assert engine_moe_layout("reference") == "transformers"
    assert [n for n, _ in moe_names("model.layers.0.mlp.experts.down_proj", torch.zeros(2, 3, 4), family,
                                    "transformers")] == ["model.layers.0.mlp.experts.down_proj"]


# ---- the real sglang model classes -----------------------------------------------------------------------
def _exports(family: str) -> dict[str, list[tuple[str, Any]]]:
    """What each trainer sends an SGLang job's engine: the torch trainer's export_weights, and the Megatron
    trainer's conversion of its (here: converted-from-HF) parameters in the layout its export picks for SGLang."""
    from milehpc.config.load import job_from_dict
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import engine_moe_layout
    from milehpc.train.megatron import convert
    from milehpc.train.megatron.model import arch_of
    from milehpc.train.torch_trainer import TorchTrainer

    hf = tiny_moe(family)
    job = job_from_dict({"name": "moe", "rollout": {"engine": "sglang"},
                         "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                   "intermediate_size": 16, "num_experts": 4, "moe_top_k": 2}})
    torch_export = [(n, t.clone()) for n, t in TorchTrainer(job, build_tokenizer("toy"), model=hf).export_weights()]
    arch = arch_of(hf.config)
    megatron = convert.from_hf(dict(tiny_moe(family).state_dict()), arch)
    megatron_export = list(convert.to_hf(megatron.items(), arch, moe_layout=engine_moe_layout(job.rollout.engine)))
    return {"torch": torch_export, "megatron": megatron_export}


def _load_into_sglang(model: Any, named: list[tuple[str, Any]]) -> dict[str, Any]:
    """Load ``named`` through the real class's ``load_weights`` into a model whose every parameter is NaN, each
    weight loader counting its calls: one call per name it consumed."""
    import torch

    calls = [0]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    for p in params.values():
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        real = getattr(p, "weight_loader", default_weight_loader)

        def counted(*args: Any, real: Any = real, **kwargs: Any) -> Any:
            calls[0] += 1
            return real(*args, **kwargs)
        p.weight_loader = counted
    model.load_weights(iter(named))
    return {"names": len(named), "consumed": calls[0],
            "unwritten": sorted(n for n, p in params.items() if bool(p.isnan().any())), "params": params}


def sglang_side(out: Path) -> None:
    """The check's own process: each family's sglang model class loads each trainer's export."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import importlib
    import socket

    import torch
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process_dist(master_port=port)
    results: dict[str, Any] = {}
    for family, (module, cls) in SGLANG_CLASSES.items():
        sglang_cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls)
        hf = tiny_moe(family)
        stacked = {n: t for n, t in hf.state_dict().items() if ".mlp.experts." in n}
        for trainer, named in _exports(family).items():
            got = _load_into_sglang(sglang_cls(hf.config), named)
            params = got.pop("params")
            # SGLang's fused experts: w13 = [gate; up] per expert = transformers' gate_up_proj, w2 = down_proj.
            experts_equal = all(
                torch.equal(params[f"model.layers.{i}.{blk}.experts.{w}_weight"],
                            stacked[f"model.layers.{i}.mlp.experts.{hf_name}"])
                for i in range(SHAPE["num_hidden_layers"])
                for w, hf_name in (("w13", "gate_up_proj"), ("w2", "down_proj"))
                for blk in ["block_sparse_moe" if family == "mixtral" else "mlp"])
            results[f"{family}/{trainer}"] = {**got, "experts_equal": experts_equal}
    out.write_text(json.dumps(results, indent=1))


@pytest.fixture(scope="module")
def sglang_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from sglang_real import require_real_sglang

    require_real_sglang()
    out = tmp_path_factory.mktemp("moe-names") / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "SGLANG_USE_CPU_ENGINE": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                                               os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("trainer", ["torch", "megatron"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_contract_sglang_model_classes_load_every_exported_moe_weight(sglang_loads: dict, family: str,
                                                                      trainer: str) -> None:
    got = sglang_loads[f"{family}/{trainer}"]
    assert got["consumed"] == got["names"], f"SGLang's {family} load_weights skipped {got['names'] - got['consumed']}" \
                                            f" of the {got['names']} names the {trainer} trainer exports"
    assert got["unwritten"] == [], f"parameters SGLang never received: {got['unwritten']}"
    assert got["experts_equal"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    sglang_side(Path(sys.argv[1]))
