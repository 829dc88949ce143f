"""Multi-LoRA ([trainer.lora.adapters.NAME]) in one process: each adapter's prompts come from its own stream and
carry its name, are generated with that adapter (the reference engine merges it exactly as peft does, whichever was
merged before) and scored with its reward; a batch of one adapter's samples steps that adapter's optimizer alone;
an interrupted two-adapter run resumes bitwise equal. The config lines (through the CLI) are in
tests/corpus/jobs/*lora-adapters*.toml; the mpirun job and the export in tests/test_lora_multi_mpi.py."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from local_interrupt import run_cut_and_resumed
from required import require_module

from milehpc.checkpoint import list_checkpoints
from milehpc.config.job import JobSpec
from milehpc.config.load import job_from_dict
from milehpc.data.adapters import adapter_mix
from milehpc.data.tokenizer import build_tokenizer
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.reference import build_engine
from milehpc.runtime.loop import run_local
from milehpc.runtime.loop.adapter_streams import adapter_scorer, generate_by_adapter
from milehpc.samples import Sample
from milehpc.train import lora
from milehpc.train.torch_trainer import TorchTrainer
from milehpc.weights.check import compare_named_tensors
from milehpc.weights.inplace import load_in_place

require_module("peft")

ADAPTERS = {"rev": {"source": "task:reverse", "params": {"min_len": 1, "max_len": 3}, "prompts_per_step": 3},
            "srt": {"source": "task:sort", "params": {"min_len": 1, "max_len": 3}, "lr": 2e-2,
                    "reward": {"name": "toy_match", "params": {"partial": 1.0}}}}


def multi_job(**tables) -> JobSpec:
    data = {"name": "multi", "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                                       "intermediate_size": 64, "max_position_embeddings": 64},
            "rollout": {"prompts_per_step": 4, "n_samples": 4, "max_new_tokens": 5},
            "trainer": {"micro_batch_size": 32, "lr": 1e-2,
                        "lora": {"rank": 4, "alpha": 8.0, "modules_to_save": ["lm_head"], "adapters": ADAPTERS}},
            "run": {"steps": 4, "loop": "sync", "seed": 3, "dump_rollouts": False}}
    for key, value in tables.items():
        data[key] = {**data.get(key, {}), **value}
    return job_from_dict(data, file="job.toml")


def _randomize(trainer: TorchTrainer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora.trainable(trainer.module, trainer.adapters):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def test_prompts_carry_their_adapter_and_each_is_generated_with_it_and_scored_by_its_reward() -> None:
    job = multi_job()
    tok = build_tokenizer("toy")
    mix = adapter_mix(job, tok)
    step = [mix.peek(p) for p in range(8)]  # two steps of 4: rev takes 3 slots, srt 1
    assert [p.metadata["adapter"] for p in step] == ["rev", "rev", "rev", "srt"] * 2
    assert [p.index for p in step] == list(range(8))  # unique across adapters: the group ids
    assert all(p.text.startswith("rev:") for p in step if p.metadata["adapter"] == "rev")
    assert all(p.text.startswith("sort:") for p in step if p.metadata["adapter"] == "srt")
    # each adapter's own stream, in its own order: rev's 4th prompt (step 1's first slot) is its stream's 4th
    assert step[4].text == mix.sources["rev"].peek(3).text and step[7].text == mix.sources["srt"].peek(1).text
    assert mix.positions(5) == {"rev": 4, "srt": 1}

    trainer = TorchTrainer(job, tok)
    engine = build_engine(job)
    _randomize(trainer, 1)
    load_in_place(engine, trainer.export_weights(), 1)
    named = list(trainer.export_weights())
    assert {n for n, _ in named} >= {"lora.scaling.rev", "lora.scaling.srt",
                                     "model.layers.0.self_attn.q_proj.lora_A.rev.weight"}
    assert trainer.sync_bytes == sum(trainer.adapter_sync_bytes.values()) > 0
    check = compare_named_tensors(named, dict(engine.named_parameters()))
    assert check.ok and check.checked == len(named), check.summary()
    # Each adapter merged exactly as peft merges it, whichever adapter was merged before (rev, srt, rev again).
    for name in ("rev", "srt", "rev"):
        engine.use_adapter(name)
        policy = copy.deepcopy(trainer.module)
        policy.base_model.set_adapter(name)  # its lm_head copy too
        merged = policy.merge_and_unload(adapter_names=[name]).state_dict()
        got = engine.model.state_dict()
        assert [k for k in merged if not torch.equal(merged[k], got[k])] == [], name
    # Routed generation: each prompt's samples are those its adapter gives (greedy), grouped by prompt position.
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5, n=2)
    out = generate_by_adapter(engine, step[:4], greedy)
    assert sorted(s.group for s in out) == [0, 0, 1, 1, 2, 2, 3, 3]
    for s in out:
        alone = engine.generate([step[s.group].ids], SamplingParams(temperature=0.0, max_new_tokens=5, n=1,
                                                                    adapter=step[s.group].metadata["adapter"]))
        assert s.response_ids == alone[0].response_ids
    other = engine.generate([step[0].ids], SamplingParams(temperature=0.0, max_new_tokens=5, n=1, adapter="srt"))
    rev_lp = [s for s in out if s.group == 0][0].rollout_logprobs
    assert max(abs(a - b) for a, b in zip(rev_lp, other[0].rollout_logprobs, strict=False)) > 1e-3  # they differ
    # Rewards: rev's is its task's (exact match), srt's is partial credit.
    scorer = adapter_scorer(job)
    a = Sample(prompt_ids=[1], response_text="12", label="13", metadata={"adapter": "rev"})
    b = Sample(prompt_ids=[1], response_text="12", label="13", metadata={"adapter": "srt"})
    scorer.score([a, b])
    assert (a.reward, b.reward) == (0.0, 0.5)


def test_a_batch_of_one_adapter_steps_that_adapter_alone() -> None:
    job = multi_job()
    trainer = TorchTrainer(job, build_tokenizer("toy"))
    _randomize(trainer, 2)
    srt_before = {n: p.detach().clone() for n, p in lora.trainable(trainer.module, ["srt"])}
    rev_before = {n: p.detach().clone() for n, p in lora.trainable(trainer.module, ["rev"])}
    # srt's samples: not the adapter peft left active (rev, the first), so the step must switch to it.
    samples = [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 2], group=g, index=i, reward=float(i % 2),
                      rollout_logprobs=[-1.0] * 3, metadata={"adapter": "srt"})
               for g in range(2) for i in range(2 * g, 2 * g + 2)]
    metrics = trainer.train_step(samples, 0)
    after = dict(trainer.module.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in rev_before.items())  # rev: not one bit moved
    assert any(not torch.equal(after[n], t) for n, t in srt_before.items())
    assert trainer.optimizers["rev"].state == {} and len(trainer.optimizers["srt"].state) == len(srt_before)
    assert metrics["adapter/srt/lr"] == 2e-2 and "adapter/rev/loss" not in metrics
    adapters = {id(p) for _, p in lora.trainable(trainer.module, ["rev", "srt"])}
    base = [p for p in trainer.module.parameters() if id(p) not in adapters]
    assert base and not any(p.requires_grad for p in base)


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    state = torch.load(newest.path / "rank-00000.pt", weights_only=True)["state"]
    trainer = state["trainer"]["trainer"]
    opt = {f"opt.{a}.{p}.{k}": v for a, o in trainer["optimizers"].items() for p, d in o["state"].items()
           for k, v in d.items()}
    cursor = {f"cursor.{k}": torch.tensor(v) for k, v in state["rollout"]["loop"]["data"]["adapters"].items()}
    return {**trainer["model"]["adapter"], **opt, **cursor}


def test_an_interrupted_two_adapter_run_resumes_bitwise_equal(tmp_path: Path) -> None:
    partial = {"name": "toy_match", "params": {"partial": 1.0}}  # rewards differ within groups: both adapters train
    adapters = {n: {"source": a["source"], "params": {"min_len": 1, "max_len": 2}, "reward": partial}
                for n, a in ADAPTERS.items()}
    job = multi_job(algorithm={"kl_coef": 0.01}, run={"steps": 3},
                    trainer={"lora": {"rank": 4, "alpha": 8.0, "modules_to_save": ["lm_head"],
                                      "adapters": adapters}})
    run_local(job, tmp_path / "whole", checkpointing=True)
    want = _final(tmp_path / "whole")
    assert {k for k in want if k.startswith("cursor.")} == {"cursor.rev", "cursor.srt"}
    run_dir = tmp_path / "cut"
    run_cut_and_resumed(job, run_dir, stop_after=0)
    got = _final(run_dir)
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    for name in ("rev", "srt"):  # both stepped their own optimizer
        assert any(k.startswith(f"opt.{name}.") for k in got), name


def test_adapter_names_torch_refuses_are_refused_and_one_named_like_a_module_exports() -> None:
    """peft keeps adapters in torch ModuleDicts, which refuse a name that is one of their attributes ('train'):
    refused in one line at load, the list checked against the installed torch. A name that is also a module's
    ('mlp') is fine, and its checkpoint exports as that adapter alone (only the adapter's own name parts renamed)."""
    import re

    import pytest

    from milehpc.config.job import ADAPTER_NAME, ADAPTER_RESERVED
    from milehpc.errors import ConfigError
    from milehpc.train.lora_export import policy_from_checkpoint

    lora_table = {"rank": 4, "alpha": 8.0, "modules_to_save": ["lm_head"]}
    with pytest.raises(ConfigError, match="trainer.lora.adapters.train"):
        multi_job(trainer={"lora": {**lora_table, "adapters": {"train": ADAPTERS["rev"], "srt": ADAPTERS["srt"]}}})
    job = multi_job(trainer={"lora": {**lora_table, "adapters": {"mlp": ADAPTERS["rev"], "srt": ADAPTERS["srt"]}}})
    trainer = TorchTrainer(job, build_tokenizer("toy"))
    # After the model is built: transformers and peft add attributes to torch modules too.
    assert {n for n in dir(torch.nn.ModuleDict()) if re.fullmatch(ADAPTER_NAME, n)} <= ADAPTER_RESERVED
    _randomize(trainer, 5)
    state = trainer.state_dict_for_checkpoint()["model"]
    module = policy_from_checkpoint(job, state, "mlp")
    got = dict(lora.trainable(module))
    want = {n.replace(".lora_A.mlp.", ".lora_A.default.").replace(".lora_B.mlp.", ".lora_B.default.")
            .replace(".modules_to_save.mlp.", ".modules_to_save.default."): p
            for n, p in lora.trainable(trainer.module, ["mlp"])}
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
