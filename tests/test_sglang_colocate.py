"""Colocated mode: the offload/onload order (Miles'), with the real SGLangEngine calls, the real torch trainer on
CPU, and *recording stand-ins* for what needs a GPU: torch_memory_saver and the in-process sglang.Engine (same
method signatures as sgl-project/sglang python/sglang/srt/entrypoints/engine.py; see test_sglang_mapping.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch
from required import require_module
from standin_gpu_stack.sglang_requests import attach

from milehpc.config.load import job_from_dict
from milehpc.config.sglang_options import parse_options
from milehpc.data.tokenizer import build_tokenizer
from milehpc.errors import RuntimeFailure
from milehpc.rollout import sglang_mapping as sm
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.sglang_engine import SGLangEngine, sigquit_handler
from milehpc.runtime.offload import ColocatedStep

MILES_ORDER = [
    "sglang.generate",
    "sglang.release_memory_occupation(cuda_graph,kv_cache,weights)",  # offload rollout
    "saver.region(train,cpu_backup=True)",  # train (its state lives in the pausable region)
    "saver.pause(train)",  # offload train
    "sglang.resume_memory_occupation(weights)",  # onload rollout weights
    "sglang.update_weights_from_tensor",  # update weights (one call per bucket)
    "sglang.flush_cache",
    "sglang.resume_memory_occupation(kv_cache,cuda_graph)",  # onload KV cache
]


class RecordingMemorySaverStandIn:
    """Stand-in for ``torch_memory_saver.torch_memory_saver`` (region/pause/resume need libcuda)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.paused: set[str] = set()

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False):
        assert tag not in self.paused, "allocating into a paused region"
        self.log.append(f"saver.region({tag},cpu_backup={enable_cpu_backup})")
        yield

    def pause(self, tag: str | None = None) -> None:
        assert tag not in self.paused
        self.paused.add(tag)
        self.log.append(f"saver.pause({tag})")

    def resume(self, tag: str | None = None) -> None:
        assert tag in self.paused
        self.paused.discard(tag)
        self.log.append(f"saver.resume({tag})")


require_module("sglang")  # milehpc builds its weight-update requests with the real sglang.srt definitions


class RecordingSGLangEngineStandIn:
    """Stand-in for ``sglang.Engine`` (needs a GPU): same method names and keyword arguments; keeps the weights
    it is sent and answers ``generate`` in SGLang's output shape."""

    def __init__(self, log: list[str], **server_args) -> None:
        attach(self)  # milehpc's weight-update requests reach the methods below
        self.log, self.server_args = log, server_args
        self.weights: dict[str, torch.Tensor] = {}
        self.released: set[str] = set()
        self.gen = torch.Generator().manual_seed(0)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 return_routed_experts=False, **_):
        assert not self.released, f"generate with released memory {self.released}"
        assert return_logprob
        self.log.append("sglang.generate")
        outs = []
        for ids, sp in zip(input_ids, sampling_params, strict=True):
            n = sp["max_new_tokens"]
            toks = torch.randint(3, 12, (n,), generator=self.gen).tolist()
            lps = (-torch.rand(n, generator=self.gen)).tolist()
            outs.append({"output_ids": toks, "meta_info": {
                "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(ids),
                "completion_tokens": n, "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, toks, strict=True)]}})
        return outs

    def release_memory_occupation(self, tags=None):
        self.released |= set(tags)
        self.log.append(f"sglang.release_memory_occupation({','.join(tags)})")

    def resume_memory_occupation(self, tags=None):
        self.released -= set(tags)
        self.log.append(f"sglang.resume_memory_occupation({','.join(tags)})")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert "weights" not in self.released, "weights updated while released"
        assert flush_cache is False and load_format is None
        for name, t in named_tensors:
            self.weights[name] = t.clone()
        self.log.append("sglang.update_weights_from_tensor")
        return True, "Succeeded to update model weights."

    def flush_cache(self):
        self.log.append("sglang.flush_cache")

    def shutdown(self):
        self.log.append("sglang.shutdown")


def _job():
    return job_from_dict({
        "name": "colo", "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                                  "intermediate_size": 64, "max_position_embeddings": 64},
        "rollout": {"engine": "sglang", "n_samples": 2, "max_new_tokens": 4,
                    "options": {"weight_bucket_mb": 1}},
        "trainer": {"micro_batch_size": 4}, "resources": {"colocate": True}}, file="job.toml")


def _score(samples):
    for i, s in enumerate(samples):
        s.reward = float(i % 2)


def _build(log, *, released: bool = False):
    """``released``: the engine is released before the trainer is built, as the loop's entry does."""
    from milehpc.train.torch_trainer import TorchTrainer

    job = _job()
    opts = parse_options(job.rollout.options)
    saver = RecordingMemorySaverStandIn(log)
    engine = SGLangEngine(job, {"model_path": "/m", "tp_size": 1, "enable_memory_saver": True}, opts,
                          colocated=True, engine_factory=lambda **kw: RecordingSGLangEngineStandIn(log, **kw))
    tokenizer = build_tokenizer("toy")
    colo = ColocatedStep(engine, None, saver, memory_probe=lambda: 0)
    if released:
        colo.offload_rollout()
    with colo.train_region():  # the trainer's parameters are allocated inside the pausable region
        colo.trainer = TorchTrainer(job, tokenizer)
    return job, engine, colo


def test_colocated_step_follows_miles_order_with_recording_standins():
    log: list[str] = []
    job, engine, colo = _build(log)
    assert log == ["saver.region(train,cpu_backup=True)"]
    log.clear()
    colo.initial_sync(version=0)
    # Miles: "always update weight first" (the engine started with random weights), trainer paused before.
    assert log[0] == "saver.pause(train)" and log[-1] == "sglang.flush_cache"
    assert set(log[1:-1]) == {"sglang.update_weights_from_tensor"}
    log.clear()
    sp = SamplingParams(max_new_tokens=4, n=2)
    samples, metrics = colo.step([[3, 4, 5], [6, 7]], sp, step=0, score=_score)
    assert len(samples) == 4 and {s.weight_version for s in samples} == {0}
    # First step: the trainer was paused by the initial sync, so it is resumed before its region is entered.
    assert log[0] == "sglang.generate" and log[1] == MILES_ORDER[1]
    assert log[2] == "saver.resume(train)"
    compact = [e for i, e in enumerate(log) if e != "saver.resume(train)" and not (
        e == "sglang.update_weights_from_tensor" and log[i - 1] == e)]
    assert compact == MILES_ORDER
    assert colo.report.events == ["generate", "offload_rollout", "onload_train", "train", "offload_train",
                                  "onload_weights", "update_weights", "onload_kv"]
    assert engine.weight_version() == 1 and metrics["colocate/update_gb"] > 0
    # What SGLang received is exactly the trainer's weights after the step (HF names, bit-exact).
    sent = engine._engine.weights
    trained = dict(colo.trainer.export_weights())
    assert set(sent) == set(trained)
    for name, t in trained.items():
        assert torch.equal(sent[name], t), name
    # A second step generates with the new weights' version.
    log.clear()
    samples, _ = colo.step([[3, 4, 5]], sp, step=1, score=_score)
    assert {s.weight_version for s in samples} == {1}


def test_released_at_start_up_and_onloaded_around_the_first_update():
    """Issue 30: released right after it starts, the engine holds nothing while the trainer is built and warmed up
    (slime offloads its engines right after creating them); the initial sync then onloads it as every step's does.
    An engine that was never released is not resumed (that would kill SGLang's scheduler): the test above."""
    log: list[str] = []
    _, engine, colo = _build(log, released=True)
    colo.initial_sync(version=0)
    compact = [e for i, e in enumerate(log) if not (e == "sglang.update_weights_from_tensor" and log[i - 1] == e)]
    assert compact == [MILES_ORDER[1], "saver.region(train,cpu_backup=True)", *MILES_ORDER[3:]]
    assert engine.weight_version() == 0 and not engine._engine.released and colo.released == set()


def test_multiple_buckets_and_one_flush():
    log: list[str] = []
    _, engine, colo = _build(log)
    big = [(f"w{i}", torch.full((300_000,), float(i))) for i in range(5)]  # 1.2 MB each, bucket = 1 MiB
    engine.update_weights(iter(big), version=7)
    assert log.count("sglang.update_weights_from_tensor") == 5 and log.count("sglang.flush_cache") == 1
    assert log[-1] == "sglang.flush_cache" and engine.weight_version() == 7
    assert engine._last_names == [n for n, _ in big]  # what named_parameters() reads back


def test_dead_engine_is_reported_and_restarted_in_place():
    log: list[str] = []
    _, engine, _ = _build(log)
    assert engine.health()
    sigquit_handler(3, None)  # what SGLang's child does on a crash: SIGQUIT to the parent
    assert not engine.health()
    with pytest.raises(RuntimeFailure, match="is down"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.restart()
    assert engine.health() and engine.restarts == 1 and engine.needs_weight_sync
    assert "sglang.shutdown" in log
    engine.opts.max_restarts = 1
    sigquit_handler(3, None)
    with pytest.raises(RuntimeFailure, match="max_restarts"):
        engine.restart()


def test_reloadable_groups_release_and_rebuild_on_gloo():
    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from milehpc.runtime.offload import ReloadableGroups
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
        made = []
        def make():
            made.append(1)
            return dist.new_group([0], backend="gloo")
        g = ReloadableGroups({"dp": make})
        t = torch.ones(3); dist.all_reduce(t, group=g.groups["dp"]); assert t.tolist() == [1.0] * 3
        old = g.groups["dp"]
        g.release(); assert g.groups == {}
        g.restore(); assert g.groups["dp"] is not old and len(made) == 2
        t = torch.ones(2); dist.all_reduce(t, group=g.groups["dp"]); assert t.tolist() == [1.0, 1.0]
        dist.destroy_process_group(); print("ok")
    """)
    from milehpc.comm.net import free_port

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr


def test_factory_writes_the_random_model_config_and_sglang_arguments(tmp_path):
    """from_context with a plan and run dir (no MPI needed for a 1-GPU engine); the sglang.Engine is a stand-in."""
    import json
    import types

    from milehpc.config.site import Launcher, Partition
    from milehpc.plan import make_plan
    from milehpc.rollout.sglang_engine import from_context

    job = job_from_dict({"name": "f", "model": {"num_experts": 4, "moe_top_k": 2, "hidden_size": 32,
                                                "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 32},
                         "rollout": {"engine": "sglang", "engines": 1},
                         "trainer": {"precision": "bf16"}}, file="job.toml")
    plan = make_plan(job, Partition(scheduler="local", launcher=Launcher(kind="mpirun"), cpus_per_node=4),
                     site="local", partition_name="local")
    ctx = types.SimpleNamespace(job=job, plan=plan, comms=types.SimpleNamespace(rank=plan.engine_leaders()[0]),
                                run_dir=tmp_path)
    log: list[str] = []
    engine = from_context(ctx, engine_factory=lambda **kw: RecordingSGLangEngineStandIn(log, **kw))
    args = engine._engine.server_args
    config = json.loads((tmp_path / "sglang-model" / "config.json").read_text())
    assert args["model_path"] == str(tmp_path / "sglang-model") and args["load_format"] == "dummy"
    assert config["num_experts"] == 4 and config["hidden_size"] == 32 and config["eos_token_id"] == 2
    assert args["dtype"] == "bfloat16" and args["enable_return_routed_experts"] is True
    assert args["skip_tokenizer_init"] is True and callable(args["custom_sigquit_handler"])
    assert engine.needs_weight_sync and engine.moe_shape == (2, 2) and engine.is_leader


def test_health_watches_the_engines_child_processes():
    """A child process the engine started (SGLang's scheduler/detokenizer) dying makes health() False."""
    import subprocess as sp

    log: list[str] = []
    children: list[sp.Popen] = []

    def factory(**kw):
        children.append(sp.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return RecordingSGLangEngineStandIn(log, **kw)

    job = _job()
    engine = SGLangEngine(job, {"model_path": "/m"}, parse_options({}), engine_factory=factory)
    try:
        assert engine.health() and children[0].pid in engine._pids
        children[0].kill()
        children[0].wait()
        assert not engine.health() and "exited" in engine._dead_reason
        engine.restart()
        assert engine.health() and children[1].pid in engine._pids
    finally:
        for c in children:
            c.kill()


def test_weight_update_waits_for_the_running_generation():
    """Never updated mid-generation: an update issued while a batch runs starts only after it returns."""
    import threading
    import time

    log: list[str] = []
    _, engine, _ = _build(log)
    inner = engine._engine
    started = threading.Event()

    def slow_generate(**kw):
        started.set()
        time.sleep(0.5)
        out = RecordingSGLangEngineStandIn.generate(inner, **kw)
        log.append("generate-done")
        return out

    inner.generate = slow_generate
    t = threading.Thread(target=engine.generate, args=([[3, 4]], SamplingParams(max_new_tokens=2)))
    t.start()
    started.wait(10)
    engine.update_weights([("w", torch.ones(3))], version=5)
    t.join(10)
    assert log.index("generate-done") < log.index("sglang.update_weights_from_tensor")


def test_multi_rank_engine_layout_uses_sglang_nodes():
    """gpus_per_engine = 2: each rank is one SGLang node; the leader's rendezvous address reaches the other."""
    import types

    from milehpc.config.site import Launcher, Partition
    from milehpc.plan import make_plan
    from milehpc.rollout.sglang_engine import engine_layout

    job = job_from_dict({"name": "l", "rollout": {"engine": "sglang", "engines": 2, "gpus_per_engine": 2},
                         "trainer": {"dp": 2}},
                        file="job.toml")
    plan = make_plan(job, Partition(scheduler="local", launcher=Launcher(kind="mpirun"), cpus_per_node=8),
                     site="local", partition_name="local")
    sent: dict[str, object] = {}

    def bcast(obj, root, ranks, *, what):  # the timed MPI broadcast of comm.world.Comms, in one process
        assert root == ranks[0] and "rendezvous" in what
        if obj is not None:
            sent["addr"] = obj
        return sent["addr"]

    leader, other = plan.engine_leaders()[1], plan.engine_leaders()[1] + 1
    lay0 = engine_layout(types.SimpleNamespace(plan=plan, job=job, comms=types.SimpleNamespace(rank=leader,
                                                                                                bcast=bcast)))
    lay1 = engine_layout(types.SimpleNamespace(plan=plan, job=job, comms=types.SimpleNamespace(rank=other,
                                                                                                bcast=bcast)))
    assert (lay0.engine, lay0.engine_rank, lay1.engine_rank) == (1, 0, 1)
    assert lay0.dist_init_addr == lay1.dist_init_addr and ":" in str(lay0.dist_init_addr)
    opts = parse_options({})
    from milehpc.config.precision import resolve_precision

    args = sm.server_args(job, opts, resolve_precision(job), lay1, model_path="/m", tokenizer_path=None)
    assert (args["tp_size"], args["nnodes"], args["node_rank"], args["base_gpu_id"]) == (2, 2, 1, 0)


class _RecordingGroups:
    """The ``groups`` a ColocatedStep takes (release/restore), recorded."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def release(self) -> None:
        self.log.append("groups.release")

    def restore(self) -> None:
        self.log.append("groups.restore")


def test_communicators_are_suspended_for_rollout_and_restored_at_the_end():
    """Issue 30: the trainer's NCCL buffers go with its memory while the engine generates, come back before it
    trains, and are live again when the run ends (the teardown destroys live communicators, not suspended ones)."""
    log: list[str] = []
    _, _, colo = _build(log)
    colo.groups = _RecordingGroups(log)
    colo.initial_sync(version=0)
    assert log.index("groups.release") < log.index("saver.pause(train)")
    log.clear()
    colo.step([[3, 4, 5]], SamplingParams(max_new_tokens=4, n=2), step=0, score=_score)
    assert log.index("saver.resume(train)") < log.index("groups.restore") < log.index("groups.release")
    assert log.count("groups.release") == log.count("groups.restore") == 1
    log.clear()
    colo.finish()
    assert log == ["groups.restore"]


def test_a_rank_whose_trainer_exports_nothing_is_refused_not_left_with_old_weights():
    """Issue 30, fault 4: a colocated rank whose trainer exports no weights (Megatron: every rank but tp0/dp0 of a
    stage) must not open and close an empty update and keep its initial weights; with ``share`` (the loop passes
    milehpc.weights.inplace.whole_model) it gets the whole model."""
    from milehpc.errors import RuntimeFailure

    log: list[str] = []
    _, engine, colo = _build(log)
    whole = list(colo.trainer.export_weights())
    colo.trainer.export_weights = lambda: []
    with pytest.raises(RuntimeFailure, match="exported no weights for its colocated engine"):
        colo.snapshot()
    colo.share = lambda named: list(named) or whole
    colo.initial_sync(version=3)
    assert engine.weight_version() == 3 and set(engine._engine.weights) == {n for n, _ in whole}
