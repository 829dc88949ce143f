"""milehpc's SGLang engine against the REAL sglang 0.5.23 ``Engine`` running on the CPU (``pytest -k contract``).

One engine (tiny random Qwen2, float32) serves the whole module: start, generation, the three weight-update paths
through milehpc's own code (tensor, disk, distributed over gloo with milehpc's trainer side), each bracketed by a
begin/end session and checked, with the engine's logprobs compared to the trainer model's after every sync; the
refusal outside a session; ``get_weights_by_name`` answering None; release/resume of memory (memory saving off);
and the real SIGQUIT path: the scheduler process killed, the rank survives, the engine restarts in place."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from sglang_real import TESTED, engine_args, require_real_sglang, tiny_qwen2

PROMPTS = [[5, 9, 3, 7], [11, 4, 8]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    require_real_sglang()
    return tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def engine(model_dir):
    from milehpc.config.sglang_options import parse_options
    from milehpc.rollout.sglang_engine import SGLangEngine

    eng = SGLangEngine(None, engine_args(model_dir), parse_options({}), eos_id=None)
    yield eng
    eng.shutdown()


def hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def generate(engine, n_tokens: int = 6):
    from milehpc.rollout.engine import SamplingParams

    return engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=n_tokens))


def trainer_logprobs(model, sample) -> list[float]:
    import torch

    ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)])
    with torch.no_grad():
        logits = model(ids).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    p = len(sample.prompt_ids)
    return [float(logp[p - 1 + i, t]) for i, t in enumerate(sample.response_ids)]


def assert_logprobs_agree(engine, model) -> list:
    """The logprob check after a sync: the engine's sampled-token logprobs equal the trainer model's."""
    samples = generate(engine)
    for s in samples:
        assert len(s.response_ids) > 0 and len(s.rollout_logprobs) == len(s.response_ids)
        want = trainer_logprobs(model, s)
        diff = max(abs(a - b) for a, b in zip(s.rollout_logprobs, want, strict=True))
        assert diff < 1e-3, f"engine vs trainer logprobs differ by {diff}"
    return samples


def test_contract_imports_the_tested_sglang():
    require_real_sglang()
    import sglang

    assert sglang.__version__ == TESTED


def test_contract_a_cpu_engines_processes_see_no_amx_and_others_keep_it():
    """A CPU engine's processes (AMX_OFF_ENV set, the start-up hook installed by setup-sglang-cpu.sh) import
    sglang without AMX; without the variable nothing changes. On a CPU with AMX sglang's own verdict flips with it
    (on AMX a float32 engine died with "rmsnorm_kernel not implemented for 'Float'", a bf16 one at its first weight
    update: "'Parameter' object has no attribute 'weight_loader'")."""
    import subprocess
    import sys

    import torch

    from milehpc.rollout.sglang_engine import AMX_OFF_ENV

    require_real_sglang()
    probe = ("import torch, sglang.srt.utils.common as c; "
             "print(torch.cpu._is_amx_tile_supported.__module__, c.cpu_has_amx_support())")
    clean = {k: v for k, v in os.environ.items() if k != AMX_OFF_ENV}
    out = subprocess.run([sys.executable, "-c", probe], env={**clean, AMX_OFF_ENV: "1"}, capture_output=True,
                         text=True, check=True, timeout=300)
    assert out.stdout.split() == ["_milehpc_sglang_cpu_hook", "False"]
    # Without the variable: this process (started without it, the hook installed alike) imports sglang here.
    import sglang.srt.utils.common as c

    assert torch.cpu._is_amx_tile_supported.__module__ == "torch.cpu"
    assert c.cpu_has_amx_support() == torch.cpu._is_amx_tile_supported()  # True on this CI machine's kind with AMX


def test_contract_a_cpu_engines_memory_is_its_budget_not_the_hosts_free_memory(monkeypatch):
    """sglang sizes a CPU engine's KV pool from the host's free memory read before and after the weights load, so
    what other processes allocate in between was charged to the engine ("Loaded weights leave no GPU memory for the
    KV cache" on a busy machine). With the budget applied, sglang's own device-memory reading is the budget less
    this process's growth, whatever the host's free memory says."""
    require_real_sglang()
    import psutil
    import torch
    from sglang.srt.utils import common

    from milehpc.rollout import sglang_cpu_memory

    real_free = common.get_free_cpu_memory
    monkeypatch.setattr(common, "get_free_cpu_memory", real_free)  # restored after the test
    host = psutil.virtual_memory()
    # Another process took nearly all the host's memory:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: host._replace(available=1 << 20))
    assert common.get_available_gpu_memory("cpu", 0, empty_cache=False) < 0.01  # sglang's own reading: ~0 GiB
    monkeypatch.setenv(sglang_cpu_memory.MEMORY_ENV, sglang_cpu_memory.budget_env(1.5)[sglang_cpu_memory.MEMORY_ENV])
    sglang_cpu_memory.apply_if_asked()
    before = common.get_available_gpu_memory("cpu", 0, empty_cache=False)
    assert abs(before - 1.5) < 0.01  # GiB, whatever the host has free
    held = torch.ones(64 << 18)  # 64 MiB resident in this process (the engine's own growth counts)
    after = common.get_available_gpu_memory("cpu", 0, empty_cache=False)
    assert 0.055 < before - after < 0.07, (before, after)
    del held


def test_contract_engine_starts_generates_and_matches_transformers(engine, model_dir):
    # Fault 1: starting at all needs a picklable custom_sigquit_handler (sglang spawns its scheduler with pickle).
    model = hf_model(model_dir)
    samples = assert_logprobs_agree(engine, model)
    import torch

    for s in samples:
        ref = model.generate(torch.tensor([s.prompt_ids]), max_new_tokens=len(s.response_ids), do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(s.prompt_ids):].tolist()
        assert list(s.response_ids) == ref


def test_contract_updates_outside_a_session_are_refused_and_milehpc_says_so(engine):
    import torch

    from milehpc.errors import RuntimeFailure
    from milehpc.rollout.sglang_engine import _check_result

    ok, message = engine._engine.update_weights_from_tensor([("model.norm.weight", torch.ones(32))])
    assert not ok and "begin_weight_update" in message
    with pytest.raises(RuntimeFailure, match="must run between begin_weight_update"):
        _check_result("update_weights_from_tensor", (ok, message))


def test_contract_update_from_tensor_then_disk_with_logprob_check(engine, model_dir):
    # Fault 2: milehpc's update brackets the bucket with begin/end_weight_update and checks every answer.
    import torch

    model = hf_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.opts.weight_bucket_mb = 1
    engine.update_weights([(n, t.detach().clone()) for n, t in model.state_dict().items()], version=1)
    assert engine.version == 1 and not engine._session_open
    assert_logprobs_agree(engine, model)
    engine.load_weights_from_disk(str(model_dir), version=2)
    assert_logprobs_agree(engine, hf_model(model_dir))


def test_contract_agent_episodes_through_the_openai_endpoint(engine, model_dir, tmp_path):
    """Issue 36: the ``agent`` generator's endpoint served by this engine: plain openai-client episodes with a tool
    call (tests/agent_engines.py), recorded token-in/token-out and checked against transformers."""
    from agent_engines import assert_agent_episodes, calculator_tokenizer, run_episodes, tool_calling_weights

    tok = calculator_tokenizer(tmp_path / "tok")
    model = tool_calling_weights(hf_model(model_dir), tok)
    engine.update_weights([(n, t.detach().clone()) for n, t in model.state_dict().items()], version=4)
    samples = run_episodes(engine, tok, episodes=4, stop_token_ids=[tok.eos_id])
    assert_agent_episodes(samples, tok, model, version=4)


def test_contract_failed_update_raises_one_clear_error_instead_of_hanging(engine, model_dir):
    import torch

    from milehpc.errors import RuntimeFailure

    # A name the model does not have is skipped without a word (Qwen2's load_weights): only the logprob check
    # after a sync can catch a wrong name map, which is why milehpc runs it.
    engine.update_weights([("model.no_such.weight", torch.ones(3))], version=10)
    assert engine.version == 10
    # A tensor of the wrong shape fails the weight loader's assertion, which kills SGLang's scheduler process: the
    # call would wait forever for its reply; milehpc raises one clear error instead, and the engine restarts.
    with pytest.raises(RuntimeFailure, match="died during update_weights_from_tensor"):
        engine.update_weights([("model.norm.weight", torch.ones(3))], version=9)
    assert engine.version == 10 and not engine._session_open and not engine.health()
    # Fault 1 (running phase): SGLang's SubprocessWatchdog SIGQUITs the rank when a child dies, and the tokenizer
    # manager's handler for it (installed on the first request, an asyncio handler: it runs while the engine's loop
    # runs, i.e. during a call) would kill_process_tree the rank. milehpc's only reports.
    seen = engine.sigquits
    engine._engine.loop.run_until_complete(watchdog_signal())
    assert engine.sigquits >= seen + 1  # the handler ran (the real watchdog's may too), and this process is here
    before = engine.restarts
    engine.restart()
    assert engine.health() and engine.needs_weight_sync and engine.restarts == before + 1
    # The replaced engine's watchdog reporting its lost child late (seen under load in CI, and here: its own late
    # signal may come too) leaves the new one serving.
    seen = engine.sigquits
    engine._engine.loop.run_until_complete(watchdog_signal())
    assert engine.sigquits >= seen + 1 and engine.health(), engine.dead_reason
    engine.load_weights_from_disk(str(model_dir), version=3)  # the re-sync
    assert_logprobs_agree(engine, hf_model(model_dir))


async def watchdog_signal() -> None:
    """What SGLang's watchdog thread does, delivered inside a call (the engine's loop running)."""
    import asyncio

    os.kill(os.getpid(), signal.SIGQUIT)
    await asyncio.sleep(0.3)


def test_contract_get_weights_by_name_none_does_not_crash(engine):
    # Fault 5: Qwen2 in sglang 0.5.23 has no get_weights_by_name: the engine answers None.
    import torch

    from milehpc.weights.check import compare_named_tensors

    assert engine._engine.get_weights_by_name("model.norm.weight", truncate_size=10) is None
    engine._last_names = ["model.norm.weight"]
    held = dict(engine.named_parameters())
    assert held == {"model.norm.weight": None}
    assert engine.unreadable == {"model.norm.weight"}
    # Issue 30: what cannot be read back fails the weight check (not a note beside a pass).
    check = compare_named_tensors([("model.norm.weight", torch.ones(32))], held)
    assert not check.ok and "unreadable" in check.summary(), check.summary()


def test_contract_update_from_distributed_over_gloo(engine, model_dir):
    """milehpc's trainer side (host_store + join_update_group, rank 0) broadcasts each bucket as one flat uint8
    tensor; the engine receives through milehpc's begin_update / join_update_group / receive_bucket (SGLang's
    flattened_bucket load format, the radix cache flushed inside each request) / finish_update."""
    import torch
    from sglang_real import leave_sync_group, sync_over_gloo

    model = hf_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    named = [(n, t.detach().contiguous()) for n, t in model.state_dict().items()]
    pg, sent = sync_over_gloo(engine, named, 4096, 4, "contract")
    assert sent > 2
    assert engine.version == 4 and not engine._session_open
    assert_logprobs_agree(engine, model)
    leave_sync_group(engine, pg)


def test_contract_flattened_bucket_layout_is_sglangs():
    """The trainer's flat bucket (milehpc, no sglang import) is byte for byte what SGLang's own FlattenedTensorBucket
    builds, and SGLang's receiver (FlattenedTensorBucket.empty from the names/dtypes/shapes milehpc sends) accepts
    its layout and cuts it back into the exact tensors. The mixed widths and odd sizes would leave a tensor at an
    unaligned offset in the order given, which SGLang refuses."""
    require_real_sglang()
    import torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from milehpc.rollout import sglang_mapping as sm

    g = torch.Generator().manual_seed(0)
    named = [("a.norm", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("b.proj", torch.randn(3, 5, generator=g)),
             ("c.mask", torch.rand(5, generator=g) > 0.5),
             ("d.embed", torch.randn(4, 3, generator=g, dtype=torch.float64)[:, :2]),  # not contiguous
             ("e.bias", torch.randn(3, generator=g).to(torch.float16)),
             ("f.scalar", torch.tensor(2.5))]
    with pytest.raises(ValueError, match="Unaligned"):
        FlattenedTensorBucket.empty(*sm.weight_metadata(named).values(), "cpu")
    flat, meta = sm.flatten_bucket(named)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert sorted(meta["names"]) == sorted(n for n, _ in named)
    ordered = [(n, dict(named)[n]) for n in meta["names"]]
    assert torch.equal(flat, FlattenedTensorBucket(named_tensors=ordered).get_flattened_tensor())
    receiver = FlattenedTensorBucket.empty(meta["names"], meta["dtypes"], meta["shapes"], "cpu")
    assert receiver.get_flattened_tensor().numel() == flat.numel()
    receiver.get_flattened_tensor().copy_(flat)  # what the broadcast does
    got = dict(receiver.reconstruct_tensors())
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_contract_release_resume_memory_in_miles_order(engine, model_dir):
    """Colocated ordering with memory saving off: release → resume weights → update → resume KV cache → generate."""
    from milehpc.rollout import sglang_mapping as sm

    model = hf_model(model_dir)
    engine.release_memory()
    engine.resume_memory(list(sm.ONLOAD_BEFORE_UPDATE))
    engine.update_weights([(n, t.detach().clone()) for n, t in model.state_dict().items()], version=5)
    engine.resume_memory(list(sm.ONLOAD_AFTER_UPDATE))
    assert_logprobs_agree(engine, model)


def test_contract_a_killed_scheduler_is_seen_exited(engine):
    """The engine's processes include SGLang's real scheduler, and its death while idle shows in health(). The
    engine is left dead: no later test uses it (the SIGQUIT handler and the restart are the failed-update test's)."""
    import psutil

    generate(engine)  # a serving engine (the running-phase SIGQUIT handler installed) whose scheduler then dies
    procs = [psutil.Process(p) for p in engine._pids if psutil.pid_exists(p)]
    scheduler = [p for p in procs if "scheduler" in " ".join(p.cmdline()) + p.name()]
    assert scheduler, [p.name() for p in procs]
    os.kill(scheduler[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.health() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.health() and "exited" in engine._dead_reason


def test_contract_server_args_are_a_msgspec_struct_and_milehpc_reads_its_fields():
    # Fault 3: dataclasses.fields(ServerArgs) raises TypeError on sglang 0.5.23's msgspec struct.
    require_real_sglang()
    from sglang.srt.server_args import ServerArgs

    from milehpc.config.sglang_options import check_against_server_args, server_arg_names
    from milehpc.errors import ConfigError
    from milehpc.rollout.sglang_engine import CPU_SERVER_ARGS

    names = server_arg_names(ServerArgs)
    assert {"model_path", "custom_sigquit_handler", "load_format", "speculative_algorithm"} <= names
    check_against_server_args({**CPU_SERVER_ARGS, "model_path": "/m"}, extra={"schedule_policy": "lpm"})
    with pytest.raises(ConfigError, match="rollout.options.server_args.no_such_arg: not an SGLang ServerArgs field"):
        check_against_server_args({"model_path": "/m"}, extra={"no_such_arg": 1})
    with pytest.raises(ConfigError, match="speculative algorithm 'BOGUS'"):
        check_against_server_args({"speculative_algorithm": "BOGUS"})
    check_against_server_args({"speculative_algorithm": "EAGLE", "quantization": "fp8", "load_format": "flash_rl"})


def test_contract_a_colocated_draft_model_keeps_its_weights_across_a_release_only_with_its_backup():
    """Issue 30: sglang 0.5.23 gives a model's weights region a CPU backup (what release/resume_memory_occupation
    restore) for the draft worker only with ``enable_draft_weights_cpu_backup`` (or the backup of every weight), the
    field milehpc sets for a colocated engine with a draft model."""
    require_real_sglang()
    import inspect

    from sglang.srt.model_executor.model_runner_components import load_model_utils
    from sglang.srt.server_args import ServerArgs

    from milehpc.config.sglang_options import check_against_server_args, server_arg_names

    assert {"enable_draft_weights_cpu_backup", "enable_weights_cpu_backup"} <= server_arg_names(ServerArgs)
    source = " ".join(inspect.getsource(load_model_utils).split())
    assert ("enable_cpu_backup = get_exec().features.enable_weights_cpu_backup or ( is_draft_worker and "
            "get_exec().features.enable_draft_weights_cpu_backup )") in source
    assert "GPU_MEMORY_TYPE_WEIGHTS, enable_cpu_backup=enable_cpu_backup" in source
    check_against_server_args({"model_path": "/m", "speculative_algorithm": "EAGLE",
                               "enable_draft_weights_cpu_backup": True})


def test_contract_fp8_rollout_reloads_with_flash_rl_and_spec_updates_target_only():
    # Fault 9, against the installed source: flash_rl is a load format of this sglang, the update requests carry a
    # selector, and "target" leaves the draft model alone.
    require_real_sglang()
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.scheduler_components.weight_updater import _parse_runner_selector

    from milehpc.config.sglang_options import parse_options, rl_quantization_args
    from milehpc.errors import ConfigError
    from milehpc.rollout.sglang_engine import SGLangEngine

    assert "flash_rl" in LOAD_FORMAT_CHOICES
    assert rl_quantization_args({"quantization": "fp8"}, random_init=False)["load_format"] == "flash_rl"
    with pytest.raises(ConfigError, match="needs a checkpoint folder"):
        rl_quantization_args({"quantization": "fp8", "load_format": "dummy"}, random_init=True)
    with pytest.raises(ConfigError, match="only for fp8"):
        rl_quantization_args({"quantization": "mxfp8"}, random_init=False)
    for req in ("BeginWeightUpdateReqInput", "UpdateWeightsFromTensorReqInput",
                "UpdateWeightsFromDistributedReqInput"):
        assert "selector" in getattr(io_struct, req).__struct_fields__
    assert _parse_runner_selector("target") == {"target"}
    spec = SGLangEngine.__new__(SGLangEngine)
    spec.server_args = {"speculative_algorithm": "EAGLE"}
    assert spec.selector == "target"
    plain = SGLangEngine.__new__(SGLangEngine)
    plain.server_args = {}
    assert plain.selector == "all"
    assert parse_options({}).max_restarts >= 1


def test_contract_colocated_tp2_sends_one_payload_per_rank():
    # Fault 4: each TP rank's scheduler deserializes index tp_rank only (TpModelWorker.deserialize_own_rank); the
    # payload at that index must be the tensors of the trainer rank on the same GPU, not the leader's.
    require_real_sglang()
    import torch
    from sglang.srt.utils import MultiprocessingSerializer

    from milehpc.config.sglang_options import parse_options
    from milehpc.errors import RuntimeFailure
    from milehpc.rollout.sglang_engine import SGLangEngine, route_payloads

    slots: list = [None, None]  # what comms.gather over the engine's ranks returns on the leader, by engine rank

    def rank(r: int) -> SGLangEngine:
        eng = SGLangEngine.__new__(SGLangEngine)
        eng.engine_rank, eng.is_leader, eng.engine_index = r, r == 0, 0
        eng.server_args, eng.opts = {"tp_size": 2}, parse_options({})
        eng.gather = lambda payload: (slots.__setitem__(r, payload), list(slots) if r == 0 else None)[1]
        return eng

    buckets = {r: [("w", torch.full((2,), float(r)))] for r in (0, 1)}  # each rank's tensors on its own GPU
    assert rank(1)._gather_payloads(buckets[1], 2) == []
    payloads = rank(0)._gather_payloads(buckets[0], 2)
    for tp_rank in (0, 1):
        (name, tensor), = MultiprocessingSerializer.deserialize(payloads[tp_rank])
        assert name == "w" and tensor.tolist() == [float(tp_rank)] * 2
    with pytest.raises(RuntimeFailure, match=r"one weight payload per TP rank \(0..1\), got ranks \[0\]"):
        route_payloads([b"x", None], 2)


def test_engine_start_retries_once_after_a_lost_port_race(capsys):
    """SGLang picks its ports free and binds them later; a child that lost the race dies during initialization
    (EADDRINUSE), and the start is tried once more, saying so, after the failed start's leftover children (sglang
    leaves its detokenizer running) are stopped and set aside; any other start error, an OOM kill (exit code -9), or
    a second loss, is raised."""
    import subprocess
    import sys

    from milehpc.rollout.sglang_engine import _alive, _children, _launch

    calls, leftovers = [], []

    def factory(**args):
        calls.append(args)
        if len(calls) == 1 or args.get("lose_twice"):
            # What a failed start leaves behind: a child of this process that outlives the dead scheduler.
            leftovers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
            raise RuntimeError("Rank 0 scheduler died during initialization (exit code: 1). If exit code is -9 "
                               "(SIGKILL), a common cause is the OS OOM killer.\nEADDRINUSE")
        return "engine"

    try:
        before = _children()
        assert _launch(factory, {"a": 1}, 3, before) == "engine" and calls == [{"a": 1}, {"a": 1}]
        leftover = leftovers[0].pid
        assert not _alive(leftover) and leftover in before  # stopped, and not counted as the engine's
        assert "SGLang engine 3 died during initialization" in capsys.readouterr().err
        with pytest.raises(RuntimeError, match="died during initialization"):
            _launch(factory, {"lose_twice": True}, 0, _children())
    finally:
        for proc in leftovers:  # the second loss's leftover (and any left by a failed assertion)
            proc.kill()
            proc.wait()
    calls.clear()

    def oom_killed(**args):
        calls.append(args)
        raise RuntimeError("Rank 0 scheduler died during initialization (exit code: -9). If exit code is -9 ...")

    with pytest.raises(RuntimeError, match="exit code: -9"):
        _launch(oom_killed, {}, 0, _children())
    assert len(calls) == 1
    calls.clear()

    def refuses(**args):
        calls.append(args)
        raise RuntimeError("some other failure")

    with pytest.raises(RuntimeError, match="some other failure"):
        _launch(refuses, {}, 0, set())
    assert len(calls) == 1
