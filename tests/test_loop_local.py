"""The loop's pieces in one process: the sync loop end to end (metrics, TensorBoard, HDF5 dumps, CLI readers),
over-sampling with the dynamic filter, partial rollouts, the multi-turn toy environment, loop state, schedules,
and the torch trainer's SFT / KL / critic paths."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from milehpc.config.job import JobSpec
from milehpc.config.load import job_from_dict
from milehpc.data.tokenizer import CharTokenizer
from milehpc.models import build_model
from milehpc.rollout.reference import ReferenceEngine
from milehpc.runtime.loop import run_local
from milehpc.runtime.loop.rollout_metrics import rollout_metrics
from milehpc.runtime.loop.rollout_side import RolloutSide
from milehpc.runtime.loop.schedule import deal_groups, required_version, sync_versions
from milehpc.runtime.loop.state import LoopState
from milehpc.samples import Sample, Status
from milehpc.train.torch_trainer import TorchTrainer, lr_factor

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
        "max_position_embeddings": 64}


def tiny_job(**sections) -> JobSpec:
    data = {"name": "t", "model": dict(TINY),
            "rollout": {"prompts_per_step": 4, "n_samples": 4, "max_new_tokens": 6},
            "trainer": {"micro_batch_size": 8}, "data": {"source": "task:sort", "params": {"min_len": 2, "max_len": 3}},
            "run": {"steps": 3}}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return job_from_dict(data)


def rollout_side(job: JobSpec, seed: int = 0) -> RolloutSide:
    tok = CharTokenizer()
    return RolloutSide(job, ReferenceEngine(build_model(job.model, tok.vocab_size, seed=seed), tok, seed=seed))


def test_run_local_writes_metrics_tensorboard_and_rollouts(tmp_path) -> None:
    from milehpc.cli import cli

    job = tiny_job(trainer={"sft_warmup_steps": 2, "sft_lr": 1e-3}, run={"check_logprobs": True})
    history = run_local(job, tmp_path)
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["rollout/samples"] == 16 and 0.0 <= h["rollout/reward_mean"] <= 1.0
        assert h["async/staleness_max"] == 0.0  # sync loop: always the current weights
        assert h["train/logprob_diff_max"] <= 1e-5  # fp32: engine and trainer agree right after a sync
        assert "train/actor/entropy" in h and "train/grad_norm" in h and h["time/step"] > 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    runner = CliRunner()
    res = runner.invoke(cli, ["rollouts", str(tmp_path), "--step", "1", "-n", "3", "--json"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)
    assert shown["attrs"]["samples"] == 16 and len(shown["samples"]) == 3
    assert shown["samples"][0]["prompt"].startswith("sort:")
    res = runner.invoke(cli, ["rollouts", str(tmp_path), "--step", "9"])
    assert res.exit_code == 2 and "no rollouts for step 9" in res.output
    res = runner.invoke(cli, ["plot", str(tmp_path)])
    assert res.exit_code == 0, res.output
    png = tmp_path / "reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dynamic_filter_drops_all_equal_groups_and_over_samples() -> None:
    # A random tiny model never sorts right: every group is all-zero and must be filtered.
    job = tiny_job(rollout={"dynamic_filter": True, "over_sample": 1.5, "options": {"max_filter_rounds": 3}})
    side = rollout_side(job)
    groups, stats = side.produce()
    assert groups == [] and stats["filtered"] == stats["samples"] / 4
    # rounds: 4 needed -> 6 prompts, then 4 missing again -> 6, 6: three rounds of ceil(4 * 1.5)
    assert stats["samples"] == 3 * 6 * 4 and side._cursor == 18
    m = rollout_metrics(stats)
    assert m["rollout/filtered_groups"] == 18 and m["rollout/groups"] == 0


def test_over_sampled_surplus_is_kept_for_the_next_step() -> None:
    job = tiny_job(rollout={"over_sample": 2.0})
    side = rollout_side(job)
    groups, _ = side.produce()
    assert len(groups) == 4 and len(side.state.ready) == 4
    groups2, stats2 = side.produce()
    assert len(groups2) == 4 and stats2["samples"] == 0 and side.state.ready == []


def test_partial_rollouts_carry_unfinished_groups_across_steps() -> None:
    job = tiny_job(rollout={"partial_rollout": True, "max_new_tokens": 6, "options": {"partial_chunk": 2}})
    side = rollout_side(job, seed=1)
    seen_multi = False
    for _ in range(6):
        groups, stats = side.produce()
        for g in groups:
            assert len(g) == 4 and all(s.status is not Status.ABORTED for s in g)
            for s in g:
                assert 1 <= len(s.response_ids) <= 6
                assert len(s.rollout_logprobs) == len(s.loss_mask) == len(s.response_ids)
                seen_multi |= len(s.metadata["versions"]) > 1
        assert all(s.group not in {x.group for g in groups for x in g} for s in side.state.carry)
        side.state.weight_version += 1  # as if weights were updated between steps
    assert seen_multi  # some samples were generated across steps
    assert any(s.status is Status.ABORTED for s in side.state.carry) or stats["carried"] == 0


def test_multi_turn_toy_environment_masks_environment_tokens() -> None:
    job = tiny_job(rollout={"generator": "toy_retry", "generator_params": {"max_turns": 3}, "max_new_tokens": 4})
    side = rollout_side(job, seed=2)
    groups, stats = side.produce()
    samples = [s for g in groups for s in g]
    retried = [s for s in samples if s.metadata["turns"] > 1]
    assert retried, "a random policy gets answers wrong, so the environment must have replied"
    tok = CharTokenizer()
    for s in retried:
        zeros = [i for i, m in enumerate(s.loss_mask) if m == 0]
        env = tok.decode([s.response_ids[i] for i in zeros])
        assert env.startswith("?") and env.endswith("=")  # the environment's feedback, e.g. "?1="
        assert all(s.rollout_logprobs[i] == 0.0 for i in zeros)
        assert len(s.loss_mask) == len(s.response_ids) == len(s.rollout_logprobs)
        assert s.reward in (0.0, 0.7, 0.49)
    assert stats["scored"] == len(samples)


def test_loop_state_round_trip_through_the_checkpoint_files(tmp_path) -> None:
    """Scalars through torch.save (the .pt shard), sample buffers through the HDF5 codec (the .h5 shard)."""
    from milehpc.samples.h5 import read_samples_h5, write_samples_h5

    st = LoopState(step=4, weight_version=3, data={"cursor": 9},
                   carry=[Sample(prompt_ids=[1], response_ids=[5], status=Status.ABORTED, group=2)],
                   ready=[[Sample(prompt_ids=[1], response_ids=[6, 2], reward=1.0, group=3)]], sft_done=True)
    torch.save(st.state_dict(), tmp_path / "s.pt")
    write_samples_h5(tmp_path / "s.h5", st.sample_buffers())
    other = LoopState()
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True), read_samples_h5(tmp_path / "s.h5"))
    assert other.step == 4 and other.weight_version == 3 and other.data == {"cursor": 9} and other.sft_done
    assert other.carry == st.carry and other.ready == st.ready
    assert other.carry[0].status is Status.ABORTED and other.ready[0][0].reward == 1.0


def test_rollout_side_state_resumes_the_prompt_stream() -> None:
    job = tiny_job()
    a = rollout_side(job)
    a.produce()
    state, buffers = a.state_dict(), a.sample_buffers()
    want = [s.prompt_text for g in a.produce()[0] for s in g]
    b = rollout_side(job)
    b.load_state_dict(state, buffers)
    assert [s.prompt_text for g in b.produce()[0] for s in g] == want


def test_weight_schedules_per_loop_mode() -> None:
    job = tiny_job(run={"steps": 6, "loop": "sync"})
    assert sync_versions(job) == [1, 2, 3, 4, 5]
    assert [required_version(job, b) for b in range(6)] == [0, 1, 2, 3, 4, 5]
    job = tiny_job(run={"steps": 6, "loop": "one_step_off"})
    assert [required_version(job, b) for b in range(6)] == [0, 0, 1, 2, 3, 4]
    job = tiny_job(run={"steps": 6, "loop": "async", "max_staleness": 2, "update_weights_interval": 2})
    assert sync_versions(job) == [2, 4]
    assert [required_version(job, b) for b in range(6)] == [0, 0, 0, 0, 2, 2]


def test_deal_groups_keeps_groups_whole_and_balances() -> None:
    groups = [[Sample(prompt_ids=[1], group=g)] * n for g, n in enumerate([4, 4, 2, 2, 2, 1])]
    shares = deal_groups(groups, 2)
    assert sorted(sum(len(g) for g in share) for share in shares) == [7, 8]
    assert sorted(g[0].group for share in shares for g in share) == list(range(6))


def test_lr_schedule_shapes() -> None:
    assert lr_factor(0, warmup=4, total=10, schedule="constant", min_ratio=0) == 0.25
    assert lr_factor(9, warmup=0, total=10, schedule="constant", min_ratio=0) == 1.0
    assert lr_factor(5, warmup=0, total=10, schedule="linear", min_ratio=0) == pytest.approx(0.5)
    assert lr_factor(10, warmup=0, total=10, schedule="cosine", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(0, warmup=0, total=10, schedule="cosine", min_ratio=0.1) == pytest.approx(1.0)


def _batch(job: JobSpec, seed: int = 0) -> list[Sample]:
    side = rollout_side(job, seed)
    groups, _ = side.produce()
    samples = [s for g in groups for s in g]
    for i, s in enumerate(samples):  # rewards with spread inside each group
        s.reward = float(i % 4 == 0)
    return samples


def test_sft_warmup_lowers_the_loss() -> None:
    from milehpc.runtime.loop.trainer_side import TrainerSide

    job = tiny_job(trainer={"sft_warmup_steps": 25, "sft_lr": 3e-3})
    tok = CharTokenizer()
    side = TrainerSide(job, TorchTrainer(job, tok), run_dir=None)
    batches = list(side.sft_batches())
    opt = side.trainer.sft_optimizer(3e-3)
    first = side.trainer.sft_step(batches[0], opt)["sft/loss"]
    for b in batches[1:]:
        last = side.trainer.sft_step(b, opt)["sft/loss"]
    assert last < 0.7 * first
    assert batches[0][0].response_ids[-1] == tok.eos_id


def test_kl_reference_and_gae_critic_paths_train() -> None:
    job = tiny_job(algorithm={"advantage": "gae", "kl_coef": 0.1})
    tok = CharTokenizer()
    trainer = TorchTrainer(job, tok)
    assert trainer.critic is not None
    trainer.freeze_reference()
    assert trainer.ref is not None
    before = {k: v.clone() for k, v in trainer.export_weights()}
    critic_before = [p.clone() for p in trainer.critic_module.parameters()]
    m1 = trainer.train_step(_batch(job), 0)
    m2 = trainer.train_step(_batch(job, 1), 1)
    assert trainer.version == 2
    assert "train/actor/kl" in m1 and m1["train/actor/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == ref
    assert m2["train/actor/kl"] > 0.0  # after one update the policy moved away from the reference
    assert "train/critic/value_loss" in m1 and m1["critic/grad_norm"] > 0
    after = dict(trainer.export_weights())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, trainer.critic_module.parameters(), strict=True))


def test_trainer_checkpoint_state_round_trip() -> None:
    job = tiny_job()
    tok = CharTokenizer()
    a = TorchTrainer(job, tok)
    a.train_step(_batch(job), 0)
    import io

    buf = io.BytesIO()  # through bytes, as a checkpoint on disk would (the live dict shares a's tensors)
    torch.save(a.state_dict_for_checkpoint(), buf)
    buf.seek(0)
    b = TorchTrainer(job, tok)
    b.load_checkpoint_state(torch.load(buf, weights_only=False))
    assert b.version == 1
    batch = _batch(job, 2)
    ma, mb = a.train_step(batch, 1), b.train_step(batch, 1)
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], abs=1e-7)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.export_weights(), b.export_weights(), strict=True))


def test_distillation_without_teacher_is_a_clear_error() -> None:
    """The job rules refuse it (milehpc.config.rules, login side); the in-process runner checks them too, before
    building anything. The torch trainer itself assumes a valid job."""
    from milehpc.errors import ConfigError

    job = tiny_job(algorithm={"advantage": "distill"})
    with pytest.raises(ConfigError, match="trainer.options.teacher_path: on-policy distillation"):
        run_local(job)


def test_run_command_rejects_bad_input_in_one_line(tmp_path) -> None:
    from milehpc.cli import cli

    job = tmp_path / "job.toml"
    job.write_text('name = "x"\n[trainer]\nlr = "fast"\n')
    res = CliRunner().invoke(cli, ["run", str(job), "--site", "local", "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "trainer.lr" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "r").exists()


def test_single_process_runs_refuse_other_loops_in_one_line() -> None:
    from milehpc.errors import ConfigError

    with pytest.raises(ConfigError, match="single-process run"):
        run_local(tiny_job(run={"loop": "one_step_off"}))


def test_a_rerun_without_a_checkpoint_rewrites_every_step_once(tmp_path) -> None:
    """A job killed before its first checkpoint committed starts again from step 0: the lost attempt's metrics and
    rollout dumps go, so each step keeps one record (what a resume from a checkpoint does from its step on)."""
    from milehpc.samples.dumps import list_steps

    job = tiny_job(checkpoint={"interval_steps": 0})

    def killed(step: int, _metrics: dict) -> None:
        if step == 1:
            raise KeyboardInterrupt("killed before any checkpoint")

    with pytest.raises(KeyboardInterrupt):
        run_local(job, tmp_path, checkpointing=True, on_step=killed)
    history = run_local(job, tmp_path, checkpointing=True)
    assert [h["step"] for h in history] == [0, 1, 2]  # nothing was committed: the rerun starts at 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert list_steps(tmp_path) == [0, 1, 2]
