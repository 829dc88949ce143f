"""Multi-LoRA ([trainer.lora.adapters.NAME]) in one process: each adapter's prompts come from its own stream and
carry its name, are generated with that adapter (the reference engine merges it exactly as peft does, whichever was
merged before) and scored with its reward; a batch of one adapter's samples steps that adapter's optimizer alone;
an interrupted two-adapter run resumes bitwise equal. The config lines (through the CLI) are in
tests/corpus/jobs/*lora-adapters*.toml; the mpirun job and the export in tests/test_lora_multi_mpi.py."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from local_interrupt import run_cut_and_resumed
from required import require_module

from milehpc.checkpoint import list_checkpoints
from milehpc.config.job import JobSpec
from milehpc.config.load import job_from_dict
from milehpc.data.adapters import adapter_mix
from milehpc.data.tokenizer import build_tokenizer
from milehpc.rewards.routing import adapter_scorer
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.reference import build_engine
from milehpc.runtime.loop import run_local
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
    mixed = [step[3], step[0], step[1], step[2]]  # srt first: the engine's grouping keeps every prompt's position
    out = engine.generate([p.ids for p in mixed], replace(greedy, adapters=[p.metadata["adapter"] for p in mixed]))
    assert sorted(s.group for s in out) == [0, 0, 1, 1, 2, 2, 3, 3]
    for s in out:
        alone = engine.generate([mixed[s.group].ids], SamplingParams(temperature=0.0, max_new_tokens=5, n=1,
                                                                     adapters=[mixed[s.group].metadata["adapter"]]))
        assert s.response_ids == alone[0].response_ids
    other = engine.generate([step[0].ids], SamplingParams(temperature=0.0, max_new_tokens=5, n=1, adapters=["srt"]))
    rev_lp = [s for s in out if s.group == 1][0].rollout_logprobs
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
    # Both adapters in one step: the job's grad_norm is the norm over both adapters' gradients, and no job-level lr
    # (each adapter has its own).
    both = samples + [replace(s, metadata={"adapter": "rev"}, group=s.group + 2) for s in samples]
    metrics = trainer.train_step(both, 1)
    assert "train/lr" not in metrics and metrics["adapter/rev/lr"] == 1e-2
    assert metrics["train/grad_norm"] == pytest.approx(math.hypot(metrics["adapter/rev/grad_norm"],
                                                                  metrics["adapter/srt/grad_norm"]), rel=1e-12)
    # Each sample scored with its own adapter (the GPU check scripts call this), whichever adapter is active.
    got = trainer.compute_logprobs(both)
    for name in ("rev", "srt"):
        trainer.module.base_model.set_adapter(name)
        mine = [s for s in both if s.metadata["adapter"] == name]
        want = trainer._logprobs(mine)
        assert [lp for lp, s in zip(got, both, strict=True) if s.metadata["adapter"] == name] == want, name
    assert both[0].metadata["adapter"] == "srt"
    trainer.module.base_model.set_adapter("rev")
    other = trainer._logprobs([both[0]])  # srt's sample scores otherwise under rev: a misrouted call would show
    assert max(abs(a - b) for a, b in zip(other[0], got[0], strict=True)) > 1e-4


def test_adapters_go_in_name_order_take_their_own_weight_decay_and_each_reaches_the_target() -> None:
    from milehpc.runtime.loop.schedule import target_reached

    srt_first = {"srt": {**ADAPTERS["srt"], "weight_decay": 0.25}, "rev": ADAPTERS["rev"]}
    job = multi_job(trainer={"lora": {"rank": 4, "alpha": 8.0, "adapters": srt_first}},
                    run={"target_reward": 0.5, "steps": 10})
    assert list(job.trainer.lora.adapters) == ["rev", "srt"]  # the TOML's order does not matter
    trainer = TorchTrainer(job, build_tokenizer("toy"))
    sft = trainer.sft_optimizer(1e-3)
    assert [sft[a].param_groups[0]["weight_decay"] for a in ("rev", "srt")] == [0.0, 0.25]
    assert trainer.optimizers["srt"].param_groups[0]["weight_decay"] == 0.25
    # run.target_reward: every adapter's mean over the last 10 steps, not the job's mean of them.
    history = [{"rollout/reward_mean": 0.6, "adapter/rev/reward_mean": 0.9, "adapter/srt/reward_mean": 0.3}] * 9
    assert not target_reached(job, history, history[0])
    history = [{"rollout/reward_mean": 0.6, "adapter/rev/reward_mean": 0.6, "adapter/srt/reward_mean": 0.55}] * 9
    assert target_reached(job, history, history[0])


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    state = torch.load(newest.path / "rank-00000.pt", weights_only=True)["state"]
    trainer = state["trainer"]["trainer"]
    opt = {f"opt.{a}.{p}.{k}": v for a, o in trainer["optimizers"].items() for p, d in o["state"].items()
           for k, v in d.items()}
    return {**trainer["model"]["adapter"], **opt, "cursor": torch.tensor(state["rollout"]["cursor"])}


def test_an_interrupted_two_adapter_run_resumes_bitwise_equal(tmp_path: Path) -> None:
    partial = {"name": "toy_match", "params": {"partial": 1.0}}  # rewards differ within groups: both adapters train
    adapters = {n: {"source": a["source"], "params": {"min_len": 1, "max_len": 2}, "reward": partial}
                for n, a in ADAPTERS.items()}
    job = multi_job(algorithm={"kl_coef": 0.01}, run={"steps": 3},
                    trainer={"lora": {"rank": 4, "alpha": 8.0, "modules_to_save": ["lm_head"],
                                      "adapters": adapters}})
    run_local(job, tmp_path / "whole", checkpointing=True)
    want = _final(tmp_path / "whole")
    assert int(want["cursor"]) > 0
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


def test_each_adapter_is_evaluated_on_its_prompts_with_it_in_the_loop_and_by_milehpc_eval(tmp_path: Path) -> None:
    """run.eval_every with two adapters: each adapter's val_source answered with that adapter and scored with its
    reward (eval/<NAME>/*), the answers in RUN_DIR/evals/; `milehpc eval --adapter NAME` of a checkpoint gives the
    loop's numbers for that adapter, and a multi-LoRA run without --adapter is refused in one line."""
    import json

    from click.testing import CliRunner

    from milehpc.cli import cli
    from milehpc.config.schema import to_dict
    from milehpc.export.run import policy_weights
    from milehpc.export.source import load_source

    adapters = {n: {**a, "val_source": a["source"]} for n, a in ADAPTERS.items()}
    job = multi_job(trainer={"lora": {"rank": 4, "alpha": 8.0, "modules_to_save": ["lm_head"], "adapters": adapters},
                             "sft_warmup_steps": 20, "sft_lr": 1e-2},  # the adapters answer differently
                    run={"steps": 2, "eval_every": 1}, eval={"max_prompts": 6, "batch_size": 4},
                    checkpoint={"interval_steps": 1})
    run = tmp_path / "run"
    history = run_local(job, run, checkpointing=True)
    (run / "job.json").write_text(json.dumps(to_dict(job)))  # what `milehpc submit` writes
    last = history[-1]
    assert last["eval/prompts"] == 12 and last["eval/rev/prompts"] == last["eval/srt/prompts"] == 6
    rows = [json.loads(line) for line in (run / "evals" / "step_00000001.jsonl").read_text().splitlines()]
    assert [r["data_source"] for r in rows] == ["rev"] * 6 + ["srt"] * 6
    assert all(r["prompt"].startswith("rev:" if r["data_source"] == "rev" else "sort:") for r in rows)
    assert {r["reward"] for r in rows if r["data_source"] == "rev"} <= {0.0, 1.0}  # rev's reward: exact match
    # Each prompt was answered by its own adapter (checkpoint 2 holds the weights evaluated at metrics step 1).
    source = load_source(run, 2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=job.rollout.max_new_tokens, n=1)
    answers = {}
    for name in ("rev", "srt"):
        engine = build_engine(job)
        engine.update_weights(policy_weights(source, name).items(), source.weight_version)
        answers[name] = [s.response_ids for s in engine.generate(
            [engine.tokenizer.encode_prompt(r["prompt"]) for r in rows], greedy)]
    assert [r["response_ids"] for r in rows] == [answers[r["data_source"]][i] for i, r in enumerate(rows)]
    assert answers["rev"] != answers["srt"]  # a prompt answered by the wrong adapter would show
    runner = CliRunner()
    for name, task in (("rev", "task:reverse"), ("srt", "task:sort")):
        res = runner.invoke(cli, ["eval", str(run), "--adapter", name, "--data", task, "--json"])
        assert res.exit_code == 0, res.output
        got = json.loads(res.stdout)["metrics"]
        assert {k: v for k, v in got.items() if k.startswith(f"eval/{name}/")} == {
            k: v for k, v in last.items() if k.startswith(f"eval/{name}/")}, name
        assert (run / "eval" / f"step_2.{name}.json").is_file()
    bad = runner.invoke(cli, ["eval", str(run), "--data", "task:sort"])
    assert bad.exit_code == 2 and "--adapter: a multi-LoRA run has one policy per adapter: expected --adapter one of " \
                                  "rev, srt, got none" in bad.output, bad.output
