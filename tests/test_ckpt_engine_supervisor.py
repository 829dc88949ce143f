"""A reference engine in a child process is SIGKILLed mid-generation: restarted in place, re-synced to the current
weights, its in-flight prompts re-queued; every prompt comes back exactly once (counted)."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch

from milehpc.config.job import JobSpec
from milehpc.config.schema import build, to_dict
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.reference import ReferenceEngine
from milehpc.rollout.supervisor import EngineSupervisor, ProcessEngine, reference_in_child

TINY = {"name": "sup", "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                                 "intermediate_size": 64}, "run": {"seed": 3}}
FACTORY = "milehpc.rollout.supervisor:reference_in_child"
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6, n=3)


@pytest.fixture(scope="module")
def job() -> JobSpec:
    return build(JobSpec, TINY)


def _trained_weights(engine: ProcessEngine | ReferenceEngine) -> list[tuple[str, torch.Tensor]]:
    """Weights that differ from the engine's seeded init (as after a training step)."""
    g = torch.Generator().manual_seed(11)
    return [(k, v + 0.05 * torch.randn(v.shape, generator=g)) for k, v in engine.named_parameters()]


def _run(job: JobSpec, *, kill_on_call: int) -> tuple[list, EngineSupervisor, list[int]]:
    engine = ProcessEngine(FACTORY, {"job": to_dict(job), "rank": 0})
    sup = EngineSupervisor(engine, chunk_prompts=2)
    pids = [engine.pid]
    try:
        weights = _trained_weights(engine)
        sup.update_weights(weights, version=7)
        calls = [0]

        def kill_mid_generation(method: str) -> None:
            if method != "generate":
                return
            calls[0] += 1
            if calls[0] == kill_on_call:  # the request is in the pipe: these prompts are in flight
                os.kill(engine.pid, signal.SIGKILL)

        engine.after_send = kill_mid_generation
        prompts = [[3 + i, 4 + i, 5] for i in range(10)]
        out = sup.generate(prompts, SAMPLING)
        pids.append(engine.pid)
        # the engine that survived runs the *current* weights, at the current version
        engine.after_send = None
        assert sup.weight_version() == 7
        now = dict(sup.named_parameters())
        for name, tensor in weights:
            assert torch.equal(now[name], tensor), name
        # partial rollouts are continued in place: the caller's Sample objects grow
        conts = copy.deepcopy(out[:2])
        before = [len(c.response_ids) for c in conts]
        assert sup.generate([], SamplingParams(max_new_tokens=2, n=1), samples=conts) is conts
        assert all(len(c.response_ids) > n for c, n in zip(conts, before, strict=True))
        return out, sup, pids
    finally:
        sup.shutdown()


@pytest.mark.slow
def test_killed_reference_engine_recovers_without_losing_or_duplicating_prompts(job: JobSpec) -> None:
    out, sup, pids = _run(job, kill_on_call=3)
    stats = sup.stats()
    assert stats["engine_restarts"] == 1 and pids[0] != pids[1]
    assert stats["prompts_completed"] == 12 and stats["prompts_lost"] == 0 and stats["duplicates_dropped"] == 0
    assert stats["prompts_requeued"] == 2 and stats["prompts_submitted"] == 14  # a chunk sent twice; 2 continued
    groups = [s.group for s in out]
    assert groups == [g for g in range(10) for _ in range(3)]
    assert all(s.prompt_ids == [3 + s.group, 4 + s.group, 5] for s in out)
    assert all(s.weight_version == 7 and s.response_ids for s in out)

    # The lost chunk was re-sampled from the engine's RNG state before it: the same samples as an engine that
    # never crashed (built the same way, here in this process) gives for the same chunks.
    clean_engine = reference_in_child(to_dict(job), rank=0)
    clean_engine.update_weights(_trained_weights(clean_engine), 7)
    clean = []
    for i in range(0, 10, 2):
        clean += clean_engine.generate([[3 + g, 4 + g, 5] for g in range(i, i + 2)], SAMPLING)
    assert [(s.response_ids, s.rollout_logprobs) for s in out] == [(s.response_ids, s.rollout_logprobs)
                                                                   for s in clean]


def test_an_engine_that_keeps_dying_ends_the_run_in_one_line(job: JobSpec) -> None:
    from milehpc.errors import RuntimeFailure

    engine = ProcessEngine(FACTORY, {"job": to_dict(job), "rank": 0})
    sup = EngineSupervisor(engine, max_restarts=0)
    engine.after_send = lambda method: os.kill(engine.pid, signal.SIGKILL) if method == "generate" else None
    try:
        with pytest.raises(RuntimeFailure, match=r"died during generate \(killed by SIGKILL\); gave up after 0"):
            sup.generate([[3, 4]], SamplingParams(max_new_tokens=2))
    finally:
        sup.shutdown()


@pytest.mark.mpi
@pytest.mark.slow
def test_engine_killed_during_a_real_run_is_recovered_and_the_run_is_unchanged(tmp_path, ckpt_reference) -> None:
    """`rollout.engine = "reference_process"` under mpirun (1 trainer + 1 rollout rank): the engine's child process
    is SIGKILLed mid-run; the run goes on and ends with the same parameters as a run with the in-process engine
    (the checkpoint tests' shared uninterrupted run of the same job, tests/ckpt_reference.py)."""
    import time

    import psutil
    from ckpt_helpers import differences, final_state, prepare_local, start_script
    from ckpt_reference import STEPS, case_toml

    run_dir = prepare_local(tmp_path, "supervised",
                            case_toml("separate-sync", env={"MILEHPC_TEST_REWARD_DELAY": "0.2"})
                            .replace('[rollout]\n', '[rollout]\nengine = "reference_process"\n'))
    ref, job = ckpt_reference("separate-sync").start(), start_script(run_dir)
    log = run_dir / "logs" / "job.out"

    def engine_children() -> list[psutil.Process]:
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if "rollout.supervisor import _worker" in cmd:
                try:
                    if str(run_dir) in " ".join(proc.parent().cmdline()):
                        out.append(proc)
                except psutil.Error:
                    pass
        return out

    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "rollouts" / "step_000003.h5").exists():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        [child] = engine_children()
        child.kill()
        assert job.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert f"engine process {child.pid} died during" in text and "restarting it in place (restart 1)" in text, text
    different = differences(ref.state(), final_state(run_dir, STEPS))
    assert not different, different[:5]


NEXT_CALLS = ["update_weights", "generate", "just_after_the_reply"]


def test_engine_killed_between_generations_keeps_its_sampling_state(job: JobSpec) -> None:
    """A death noticed at the next call of any kind (not mid-generation) must not reset the engine's RNG: the
    following generation gives the samples of an engine that never died. ``just_after_the_reply``: the engine dies
    the moment it has answered a generation, before the supervisor could ask anything else. One supervised engine
    dies once per case, in turn (one child start per case, not two: CI time), against one engine that never died
    making the same calls: each restart must restore the RNG state the previous one left."""
    prompts = [[3, 4, 5], [6, 7, 5]]
    clean_engine = reference_in_child(to_dict(job), rank=0)
    weights = _trained_weights(clean_engine)
    clean_engine.update_weights(weights, 7)

    engine = ProcessEngine(FACTORY, {"job": to_dict(job), "rank": 0})
    sup = EngineSupervisor(engine)
    try:
        sup.update_weights(weights, version=7)
        for restarts, next_call in enumerate(NEXT_CALLS, start=1):
            clean_engine.generate(prompts, SAMPLING)
            if next_call == "update_weights":
                clean_engine.update_weights(weights, 8)
            want = clean_engine.generate(prompts, SAMPLING)

            before = engine.pid
            if next_call == "just_after_the_reply":
                answer = engine.call

                def answer_then_die(method: str, *args: object, _answer=answer) -> object:
                    out = _answer(method, *args)
                    if method.startswith("generate"):
                        del engine.call  # once
                        os.kill(engine.pid, signal.SIGKILL)
                        engine.proc.wait()
                    return out

                engine.call = answer_then_die
            sup.generate(prompts, SAMPLING)
            if next_call != "just_after_the_reply":
                os.kill(engine.pid, signal.SIGKILL)  # idle: noticed at the next call
            if next_call == "update_weights":
                sup.update_weights(weights, version=8)
            got = sup.generate(prompts, SAMPLING)
            assert engine.pid != before and sup.stats()["engine_restarts"] == restarts, next_call
            assert [(s.response_ids, s.rollout_logprobs) for s in got] == [(s.response_ids, s.rollout_logprobs)
                                                                           for s in want], next_call
    finally:
        sup.shutdown()
