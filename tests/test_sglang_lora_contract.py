"""``[trainer.lora]`` on the REAL sglang 0.5.23 engine on the CPU (``pytest -k contract``): an adapter made by
``peft`` on a tiny Qwen2 (milehpc's own :func:`milehpc.train.lora.attach` / :func:`~milehpc.train.lora.export`, what
a sync carries) goes through milehpc's :meth:`SGLangEngine.update_weights` into SGLang's LoRA API, and the engine's
greedy output equals ``PeftModel`` + transformers' ``generate`` (logprobs agree as after any sync); a second version
replaces the first (output follows it, the first is unloaded); two named adapters (multi-LoRA) loaded side by side, each
request routed to its own (greedy output equal to peft's with that adapter). One engine for the module, started with
the multi-LoRA job's server arguments; LoRA on the CPU needs
:mod:`milehpc.rollout.sglang_lora`'s torch_native backend and its pinning shim in the scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest
from required import require_module
from sglang_real import TESTED, engine_args, require_real_sglang, tiny_qwen2

PROMPTS = [[5, 9, 3, 7], [11, 4, 8], [20, 21]]
ADAPTERS = ("rev", "srt")
EOS = 2  # tiny_qwen2's eos_token_id
NEW = 6

require_module("peft")


@pytest.fixture(scope="module")
def spec():
    from milehpc.config.job import LoraSpec

    return LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def multi_spec():
    from milehpc.config.job import AdapterSpec, LoraSpec

    return LoraSpec(rank=4, alpha=8.0, adapters={a: AdapterSpec(source="task:reverse") for a in ADAPTERS})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    require_real_sglang()
    return tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-lora"))


@pytest.fixture(scope="module")
def engine(model_dir, spec, multi_spec):
    from milehpc.config.sglang_options import parse_options
    from milehpc.rollout import sglang_lora
    from milehpc.rollout.sglang_engine import SGLangEngine

    # The multi-LoRA job's arguments (one slot per adapter + the base); the one-adapter tests run on them alike.
    args = engine_args(model_dir, **sglang_lora.server_args(multi_spec, cpu=True))
    assert args["max_loras_per_batch"] == len(ADAPTERS) + 1
    eng = SGLangEngine(None, args, parse_options({}), eos_id=None, lora=spec)  # retries a lost port race itself
    yield eng
    eng.shutdown()


def policy(model_dir: Path, spec, seed: int):
    """The trainer's peft policy over the tiny Qwen2, its adapter trained away from zero (B = 0 is the base)."""
    import torch
    from transformers import AutoModelForCausalLM

    from milehpc.train import lora

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    module = lora.attach(base, spec, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.trainable(module):
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "lora_B" in name else 0.1))
    return module.eval()


def greedy(engine, adapter: str | None = None, *, adapters: list[str] | None = None) -> list:
    """Greedy answers to PROMPTS: with the job's one adapter, the named ``adapter``, or each prompt's ``adapters``."""
    from milehpc.rollout.engine import SamplingParams

    if adapter is not None:
        adapters = [adapter] * len(PROMPTS)
    return engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=NEW, adapters=adapters))


def peft_greedy(module) -> list[list[int]]:
    """transformers' greedy continuations, each cut after the model's EOS (SGLang stops at the config's EOS)."""
    import torch

    out = [module.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return [r[:r.index(EOS) + 1] if EOS in r else r for r in out]


def assert_logprobs_agree(samples, module) -> None:
    import torch

    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(module(input_ids=ids).logits[0, :-1].float(), dim=-1)
        p = len(s.prompt_ids)
        want = [float(logp[p - 1 + i, t]) for i, t in enumerate(s.response_ids)]
        diff = max(abs(a - b) for a, b in zip(s.rollout_logprobs, want, strict=True))
        assert diff < 1e-3, f"engine vs peft logprobs differ by {diff}"


def test_contract_lora_imports_the_tested_sglang():
    require_real_sglang()
    import sglang

    assert sglang.__version__ == TESTED


def test_contract_peft_adapter_loads_and_a_new_version_replaces_it(engine, model_dir, spec):
    from milehpc.train import lora

    base_out = [s.response_ids for s in greedy(engine)]  # no adapter loaded yet: the base (B = 0 policy)
    assert engine.adapter_names.get(None) is None
    seen = []
    for version, seed in ((1, 1), (2, 2)):
        module = policy(model_dir, spec, seed)
        engine.update_weights(lora.export(module, spec), version=version)
        assert engine.version == version and engine.adapter_names.get(None) == f"milehpc-policy-v{version}-{version}"
        samples = greedy(engine)
        want = peft_greedy(module)
        assert [s.response_ids for s in samples] == want, version
        assert_logprobs_agree(samples, module)
        seen.append(want)
        # The weight check's engine side: the adapter handed to SGLang and its scaling, as the trainer exported them
        # (SGLang cannot read an adapter back; the greedy output and logprobs above show it serves this one).
        sent = dict(lora.export(module, spec))
        held = dict(engine.named_parameters())
        assert held.keys() == sent.keys() and all((held[n] == sent[n]).all() for n in sent)
    # Each adapter changes the output, and the second replaced the first: only it stays loaded in SGLang.
    assert seen[0] != base_out and seen[1] != seen[0]
    # sglang 0.5.23 has no public listing of loaded adapters: its tokenizer manager's registry is read directly.
    registry = engine._engine.tokenizer_manager.lora_registry
    assert set(registry.get_all_adapters()) == {"milehpc-policy-v2-2"}
    # The same version again (a re-sent sync) loads under a new name before the old one goes ("already loaded"
    # otherwise; unloading first would leave the base model serving if the load failed).
    engine.update_weights(lora.export(module, spec), version=2)
    assert [s.response_ids for s in greedy(engine)] == seen[1]
    assert set(registry.get_all_adapters()) == {"milehpc-policy-v2-3"}


def test_contract_several_adapters_load_side_by_side_and_route_per_request(engine, model_dir, multi_spec):
    """Multi-LoRA: one sync carries both adapters under their names (milehpc.train.multi_lora's export); each loads
    under its own versioned name, and a request naming an adapter gets that adapter's greedy output (peft's, that
    adapter active), whichever was asked before, also with both adapters in one batch; a second version replaces
    both (loaded before the old ones go)."""
    import torch
    from transformers import AutoModelForCausalLM

    from milehpc.train import lora

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    module = lora.attach(base, multi_spec, seed=0).eval()
    registry = engine._engine.tokenizer_manager.lora_registry
    for version in (10, 11):
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in lora.trainable(module, list(ADAPTERS)):
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if "lora_B" in name else 0.1))
        sent = [(n, t.clone()) for a in ADAPTERS for n, t in lora.export(module, multi_spec, a)]
        engine.update_weights(iter(sent), version=version)
        names = {a: engine.adapter_names[a] for a in ADAPTERS}
        assert names == {a: f"milehpc-{a}-v{version}-{engine._adapter_loads - len(ADAPTERS) + 1 + i}"
                         for i, a in enumerate(ADAPTERS)}
        named = {n for n in registry.get_all_adapters() if not n.startswith("milehpc-policy-")}
        assert named == set(names.values()), version  # the previous version's adapters are unloaded
        want = {}
        for a in ADAPTERS:
            module.base_model.set_adapter(a)
            want[a] = peft_greedy(module)
        assert want["rev"] != want["srt"]  # the adapters differ in output: a misrouted request shows
        for a in (*ADAPTERS, ADAPTERS[0]):  # interleaved: each request goes to its own adapter, both stay loaded
            samples = greedy(engine, a)
            assert [s.response_ids for s in samples] == want[a], (version, a)
            module.base_model.set_adapter(a)
            assert_logprobs_agree(samples, module)
        # One batch, each prompt with its own adapter (SGLang serves them together): each its adapter's answer.
        mixed = ["srt", "rev", "srt"]
        samples = greedy(engine, adapters=mixed)
        assert [s.response_ids for s in samples] == [want[a][i] for i, a in enumerate(mixed)], version
        for a in ADAPTERS:
            module.base_model.set_adapter(a)
            assert_logprobs_agree([s for s, m in zip(samples, mixed, strict=True) if m == a], module)
        held = dict(engine.named_parameters())
        assert held.keys() >= {n for n, _ in sent} and all((held[n] == t).all() for n, t in sent)


def test_contract_a_load_failing_partway_leaves_the_previous_adapters_alone(engine, model_dir, multi_spec,
                                                                            monkeypatch):
    """A sync whose second adapter SGLang refuses (its config names a rank above the engine's max_lora_rank): the
    error is one RuntimeFailure, the first adapter's new name is unloaded again, and the previous version's adapters
    stay loaded and serving (runs after the multi-LoRA test, which left both loaded)."""
    from milehpc.errors import RuntimeFailure
    from milehpc.rollout import sglang_lora

    before = dict(engine.adapter_names)
    assert set(ADAPTERS) <= set(before), before
    registry = engine._engine.tokenizer_manager.lora_registry
    loaded = set(registry.get_all_adapters())
    answers = {a: [s.response_ids for s in greedy(engine, a)] for a in ADAPTERS}
    real, calls = sglang_lora.config_dict, []

    def second_refused(tensors, spec):
        calls.append(1)
        return {**real(tensors, spec), **({"r": 4 * spec.rank} if len(calls) == 2 else {})}

    monkeypatch.setattr(sglang_lora, "config_dict", second_refused)
    sent = [(n, t.clone()) for n, t in engine.named_parameters() if ".rev." in n or ".srt." in n]
    with pytest.raises(RuntimeFailure, match="load_lora_adapter_from_tensors"):
        engine.update_weights(iter(sent), version=99)
    assert len(calls) == 2 and engine.health() and engine.adapter_names == before and engine.version != 99
    assert set(registry.get_all_adapters()) == loaded  # rev's v99 name went again
    assert {a: [s.response_ids for s in greedy(engine, a)] for a in ADAPTERS} == answers


def test_contract_a_lora_engine_dying_inside_a_generate_call_answers_it_after_a_restart(engine, model_dir, spec):
    """Separate rollout ranks: the scheduler dies while the generate call is under way (killed as the call enters
    SGLang): the engine restarts in place with LoRA enabled, reloads every adapter the rank held (same version, same
    greedy output and logprobs as peft) and answers the same call, instead of ending the run. An engine found dead
    before a call takes the same restart first (milehpc.rollout.sglang_lora); the death noticed at a sync:
    tests/test_sglang_lora_loop_real.py. One restart for both checks (CI time)."""
    from milehpc.train import lora

    module = policy(model_dir, spec, 4)
    engine.update_weights(lora.export(module, spec), version=4)
    # The named adapters the multi-LoRA test left loaded come back too (a restart reloads every adapter held).
    named = {a: [s.response_ids for s in greedy(engine, a)] for a in engine.adapter_names if a is not None}
    restarts, real = engine.restarts, engine._engine.generate

    def dies_inside(*args, **kwargs):
        engine._engine.generate = real  # once: the restarted engine is a new object anyway
        engine.kill_scheduler()  # what MILEHPC_FAULT=scheduler:N does: SIGKILL to the scheduler process
        return real(*args, **kwargs)

    engine._engine.generate = dies_inside
    samples = greedy(engine)
    assert engine.restarts == restarts + 1 and engine.health() and engine.version == 4
    assert [s.response_ids for s in samples] == peft_greedy(module) and {s.weight_version for s in samples} == {4}
    assert_logprobs_agree(samples, module)
    registry = engine._engine.tokenizer_manager.lora_registry
    assert set(registry.get_all_adapters()) == set(engine.adapter_names.values())
    assert {a: [s.response_ids for s in greedy(engine, a)] for a in named} == named and set(named) == set(ADAPTERS)
