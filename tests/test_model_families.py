"""Every supported model family (milehpc.config.families) end to end on tiny random HF folders (tests/family_models.py,
built with transformers, no downloads): the family read from the folder's config.json; the Megatron trainer in one
process (tests/model_family_checks.py: logprobs vs transformers, export names and weights exact, two RL steps,
the export reloaded by ``AutoModelForCausalLM`` with the trainer's logprobs); the torch trainer and the reference
engine (``run_local``: two RL steps from the folder, ``milehpc export``, the reload's logits equal the trainer's);
an unsupported family, rope type or sliding window refused in one line. TP=2 x PP=2 of a Qwen3 with Llama-3 rope
scaling: the ``family`` case of tests/megatron_checks.py's ``parity4`` group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from family_models import FAMILY_CONFIGS, save_tiny, tiny_config

from milehpc.cli import cli
from milehpc.config.families import FAMILIES, RANDOM_ARCHS, VISION_FAMILIES
from milehpc.config.load import job_from_dict
from milehpc.config.schema import to_dict
from milehpc.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
KINDS = list(FAMILY_CONFIGS)
MEGATRON_KINDS = [k for k in KINDS if FAMILIES[k].megatron]
TOY_VOCAB = 61  # >= the toy tokenizer's 55, odd


def test_every_trained_family_has_a_tiny_model() -> None:
    # Qwen2-MoE and Mixtral: tests/test_megatron_convert.py and tests/megatron_single_checks.py
    assert set(KINDS) | {"qwen2_moe", "mixtral"} == set(FAMILIES)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("megatron.core")
    work = tmp_path_factory.mktemp("families")
    out = work / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "model_family_checks.py"), str(out), str(work)],
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", MEGATRON_KINDS)
def test_megatron_trainer_loads_trains_and_exports_the_family(megatron: dict, kind: str) -> None:
    got = megatron[kind]
    assert "error" not in got, got.get("traceback", got)
    assert got["model_type"] == kind and got["qk_norm"] == FAMILIES[kind].qk_norm
    assert got["vs_hf_logprobs"] < 1e-5  # layout, rope, norms: any error there is > 1e-2
    assert got["export_names_equal"] and got["export_vs_hf"] == 0.0
    assert all(g > 0 for g in got["grad_norms"]) and got["weights_moved"] > 1e-3
    assert got["export_reload_vs_trainer_logprobs"] < 1e-5


@pytest.mark.parametrize("kind", MEGATRON_KINDS)
def test_converter_checkpoint_names_are_the_folders_own(kind: str, tmp_path: Path) -> None:
    """Megatron -> HF in the checkpoint layout (what SGLang's loaders read by name) gives exactly the tensors
    transformers saved for the family (Qwen3's q_norm/k_norm, Qwen3-MoE's per-expert names)."""
    from safetensors.torch import load_file

    from milehpc.train.megatron import convert
    from milehpc.train.megatron.model import arch_of

    model = save_tiny(kind, tmp_path, TOY_VOCAB, seed=1)
    saved = load_file(str(tmp_path / "model.safetensors"))
    arch = arch_of(model.config)
    back = dict(convert.to_hf(convert.from_hf(saved, arch).items(), arch, moe_layout="checkpoint"))
    assert sorted(back) == sorted(saved)
    assert all(torch.equal(back[k], saved[k]) for k in saved)


# ---- the torch trainer and the reference engine, from the folder ---------------------------------------------

def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("kind", KINDS)
def test_torch_run_from_a_folder_trains_and_exports_the_family(kind: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from milehpc.runtime.loop import run_local
    from milehpc.train.torch_trainer import TorchTrainer

    folder = tmp_path / kind
    initial = save_tiny(kind, folder, TOY_VOCAB, seed=3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = job_from_dict({"name": f"fam-{kind}", "model": {"path": str(folder)},
                         "rollout": {"prompts_per_step": 2, "n_samples": 4, "max_new_tokens": 4},
                         "trainer": {"micro_batch_size": 8, "lr": 1e-2},
                         "reward": {"name": "ckpt_reshard_entries:token_reward"},
                         "data": {"source": "task:sort", "params": {"min_len": 2, "max_len": 3}},
                         "run": {"steps": 2, "loop": "sync", "dump_rollouts": False, "check_logprobs": True}})
    (run_dir / "job.json").write_text(json.dumps(to_dict(job)))
    seen: list[TorchTrainer] = []
    real_init = TorchTrainer.__init__

    def keep(self: TorchTrainer, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)
        seen.append(self)

    monkeypatch.setattr(TorchTrainer, "__init__", keep)  # the run's own trainer: the logits to compare with
    history = run_local(job, run_dir, checkpointing=True)
    assert [h["step"] for h in history] == [0, 1] and history[0]["train/grad_norm"] > 0
    # The reference engine samples with the trainer's weights: its logprobs are the trainer's.
    assert all(h["train/logprob_diff_max"] <= 1e-5 for h in history), history
    result = CliRunner().invoke(cli, ["export", str(run_dir), "-o", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.model_type == kind
    ids = torch.randint(3, TOY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    want = _logits(seen[0].module, ids)
    assert torch.equal(_logits(model, ids), want)
    assert not torch.allclose(_logits(initial, ids), want)  # the trained weights, not the folder's


# ---- the family from config.json; refusals -------------------------------------------------------------------

@pytest.mark.parametrize("arch", RANDOM_ARCHS)
@pytest.mark.parametrize("experts", [0, 4])
def test_random_model_of_each_arch_is_built_as_its_family(arch: str, experts: int) -> None:
    from milehpc.models import causal_lm_class, hf_config

    job = job_from_dict({"name": "r", "model": {"arch": arch, "num_experts": experts, "hidden_size": 32,
                                                "num_heads": 4, "num_kv_heads": 2}})
    fam = FAMILIES[arch]
    if experts and fam.moe_of is None:
        with pytest.raises(ConfigError, match="model.arch: expected arch in qwen2, qwen3 for a mixture"):
            hf_config(job.model, 55)
        return
    want = fam.moe_of if experts else arch
    config = hf_config(job.model, 55)
    assert config.model_type == want and causal_lm_class(job.model).__name__ == FAMILIES[want].causal_lm
    if want.startswith("qwen3"):
        assert config.head_dim == 8  # hidden / heads, not Qwen3's default 128


def _plan(tmp_path: Path, folder: Path, backend: str = "torch") -> object:
    job = tmp_path / "job.toml"
    job.write_text(f'name = "f"\n[model]\npath = "{folder}"\n[trainer]\nbackend = "{backend}"\n')
    return CliRunner().invoke(cli, ["plan", str(job), "--site", "local"])


def test_plan_reads_the_family_from_config_json_and_refuses_an_unsupported_one(tmp_path: Path) -> None:
    import transformers

    good = tmp_path / "qwen3"
    save_tiny("qwen3", good, TOY_VOCAB)
    assert _plan(tmp_path, good).exit_code == 0 and _plan(tmp_path, good, "megatron").exit_code == 0
    glm = tmp_path / "glm4"
    save_tiny("glm4", glm, TOY_VOCAB)
    assert _plan(tmp_path, glm).exit_code == 0
    result = _plan(tmp_path, glm, "megatron")  # GLM-4: the torch trainer's only
    assert result.exit_code == 2
    line, = result.stderr.strip().splitlines()
    assert "trainer.backend: expected trainer.backend = 'torch' for a glm4 model" in line, line
    bad = tmp_path / "gemma"
    transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(
        vocab_size=TOY_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8)).save_pretrained(bad)
    result = _plan(tmp_path, bad)
    assert result.exit_code == 2
    line, = result.stderr.strip().splitlines()
    known = ", ".join(sorted({**FAMILIES, **VISION_FAMILIES}))
    assert line.endswith(f"model.path: expected a config.json model_type in: {known}; got "
                         "'gemma2'"), line
    # ... and the ranks, which may see a folder the login node does not, say the same.
    from milehpc.models import build_model

    with pytest.raises(ConfigError, match="got 'gemma2'"):
        build_model(job_from_dict({"name": "f", "model": {"path": str(bad)}}).model, 55)


@pytest.mark.parametrize(("kind", "extra", "says"), [
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64}},
     "expected rope_type 'default' or 'llama3' in config.json, got 'yarn'"),
    ("mistral", {"sliding_window": 64}, "expected no sliding window shorter than max_position_embeddings (256)"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "expected every layer an MoE layer in a qwen3_moe config.json"),
])
def test_megatron_refuses_what_it_cannot_compute_in_one_line(kind: str, extra: dict, says: str) -> None:
    from milehpc.train.megatron.model import arch_of

    with pytest.raises(ConfigError) as info:
        arch_of(tiny_config(kind, TOY_VOCAB, **extra))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_megatron_trainer_refuses_a_family_it_cannot_express_in_one_line() -> None:
    from milehpc.train.megatron.model import arch_of

    with pytest.raises(ConfigError) as info:
        arch_of(tiny_config("glm4", TOY_VOCAB))
    assert str(info.value).startswith("trainer.backend: expected trainer.backend = 'torch' for a glm4 model (the "
                                      "Megatron trainer takes llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, "
                                      "qwen3_moe), got 'megatron'"), info.value
