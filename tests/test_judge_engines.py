"""Issue 35: the generative judge on an engine plugin, and the reward model released while the engine generates.

* The judge's ``engine`` (and its ``engine_options``, that engine's ``rollout.options``) checked on the login node as
  the rollout engine is: an unknown engine, an unknown or reserved option, an engine the site's image lacks, a model
  family the engine's adapter does not map — each one line, exit code 2.
* The **real SGLang CPU engine** gives the judge's greedy answers and verdicts of the reference engine for the same
  tiny judge (a random Qwen2 with a word-level tokenizer), built through the ``sglang`` engine plugin's own factory.
* ``[reward_model] colocate = "rollout"``: a step runs offload -> generate -> onload -> score with the RM's tensors
  off the device (0 bytes held) while the engine generates, and every sample's reward is the RM's logit recomputed
  from a fresh load; the memory estimate of a GPU site counts the larger of the KV cache and the RM, not both.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_model import TINY_MODEL

from milehpc.cli import cli

GPU_SITE = "dgx-h100-like"
WORDS = ["<pad>", "<s>", "</s>", *"0123456789", *"abcdefghij", ":", "="]  # the judge's word-level vocabulary
TEMPLATE = "{prompt} {response} :"


@pytest.fixture(autouse=True)
def _no_scorer_left_behind():
    """Each test's loaded scorers (judges with their engines, RMs) shut down and forgotten after it: no later test
    in this worker finds them cached."""
    yield
    from milehpc.rewards.model_scorers import _LOADED

    for scorer in list(_LOADED.values()):
        if hasattr(scorer, "shutdown"):
            scorer.shutdown()
    _LOADED.clear()


def _cli(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory) -> Path:
    """A random tiny Qwen2 causal LM (the family SGLang's CPU path serves) and its word-level tokenizer."""
    from sglang_real import tiny_qwen2
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = tiny_qwen2(tmp_path_factory.mktemp("judge"), seed=3, vocab=len(WORDS))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(out)
    return out


def judge_job(folder: Path, judge: str, *, extra: str = "") -> str:
    return textwrap.dedent(f"""
        name = "judge-engines"
        [data]
        source = "task:sort"
        params = {{ min_len = 3, max_len = 3 }}
        [rollout]
        prompts_per_step = 2
        n_samples = 2
        max_new_tokens = 4
        [reward]
        name = "judge"
        params = {{ path = "{folder}", template = "{TEMPLATE}", {judge} }}
        {extra}
    """) + TINY_MODEL


# ---- login side ------------------------------------------------------------------------------------------------

@pytest.fixture
def qwen2_folder(tmp_path: Path) -> Path:
    """What the login node reads of a judge folder: its config.json."""
    (tmp_path / "judge").mkdir()
    (tmp_path / "judge" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return tmp_path / "judge"


@pytest.mark.parametrize(("judge", "field", "expect"), [
    ('engine = "nope"', "reward.params.engine", "unknown engine"),
    ('engine = "sglang", engine_options = { bogus = 1 }', "reward.params.engine_options.bogus",
     "unknown parameter"),
    ('engine = "sglang", engine_options = { server_args = { model_path = "x" } }',
     "reward.params.engine_options.server_args.model_path",
     "set by milehpc from reward.params.path; change that instead"),
    ('engine = "vllm", engine_options = { kv_cache_gib = -1 }', "reward.params.engine_options.kv_cache_gib",
     "expected a value >= 0.01, got -1.0"),
])
def test_bad_judge_engines_are_one_line(qwen2_folder: Path, tmp_path: Path, judge: str, field: str,
                                        expect: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(judge_job(qwen2_folder, judge))
    res = _cli("plan", str(job), "--site", "local")
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and f"{job}: {field}: " in lines[0] and expect in lines[0], lines


def test_judge_engine_the_sites_image_lacks_and_an_unmapped_family_are_refused(qwen2_folder: Path,
                                                                              tmp_path: Path) -> None:
    from milehpc.config.load import job_from_dict, load_site, read_toml
    from milehpc.config.rules import engine_is_in_the_container
    from milehpc.errors import ConfigError

    job = tmp_path / "job.toml"
    job.write_text(judge_job(qwen2_folder, 'engine = "sglang"', extra='[container]\nimage = "/images/rocm.sif"')
                   .replace("[rollout]", '[rollout]\nengine = "vllm"'))
    spec = job_from_dict(read_toml(job), file=str(job))
    partition = load_site("frontier-like", spec, str(job))[1]  # its ROCm image: vLLM and the reference engines
    with pytest.raises(ConfigError) as err:
        engine_is_in_the_container(spec, partition, str(job))
    assert str(err.value) == (
        f"{job}: reward.params.engine: expected an engine the site's apptainer image has (site field "
        "containers.apptainer.engines = vllm, reference, reference_process; an image with other engines: restate the "
        "list in the job's [site.containers.apptainer] engines), got 'sglang'")
    spec.reward.params["engine"] = "reference"  # the same judge on an engine the image has passes
    engine_is_in_the_container(spec, partition, str(job))
    # a GPT-2 judge: the reference engine takes any causal LM; the SGLang adapter maps milehpc's families only
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    job.write_text(judge_job(gpt2, 'engine = "sglang"'))
    res = _cli("plan", str(job), "--site", "local")
    assert res.exit_code == 2 and "reward.params.path: expected a config.json model_type in" in res.output, res.output
    job.write_text(judge_job(gpt2, 'engine = "reference"'))
    assert _cli("plan", str(job), "--site", "local").exit_code == 0


# ---- the judge on the real SGLang engine -----------------------------------------------------------------------

def _greedy_margins(folder: Path, prompts: list[list[int]], answers: list[list[int]]) -> tuple[list[float], float]:
    """Each prompt's smallest gap between the top two logits along its greedy answer (transformers), and the largest
    logit magnitude seen."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    margins, biggest = [], 0.0
    with torch.no_grad():
        for p, a in zip(prompts, answers, strict=True):
            logits = model(torch.tensor([p + a])).logits[0, len(p) - 1:len(p) + len(a) - 1]
            top = logits.topk(2, dim=-1).values
            margins.append(float((top[:, 0] - top[:, 1]).min()))
            biggest = max(biggest, float(logits.abs().max()))
    return margins, biggest


@pytest.mark.slow(minutes=0.5)
def test_judge_on_real_sglang_gives_the_reference_engines_greedy_verdicts(judge_folder: Path) -> None:
    import random

    import torch
    from sglang_real import require_real_sglang

    from milehpc.rewards.model_scorers import _LOADED
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.judge import load_judge, score_judge
    from milehpc.samples import Sample

    require_real_sglang()
    rng = random.Random(0)
    samples = [Sample(prompt_ids=[], prompt_text=" ".join(rng.choices("0123456789", k=3)),
                      response_text=" ".join(rng.choices("0123456789abc", k=3)), label="") for _ in range(24)]
    params = {"path": str(judge_folder), "template": TEMPLATE, "answer_pattern": r"(\d)", "retries": 0,
              "max_new_tokens": 4}
    sgl_options = {"cpu_memory_gib": 0.5}  # the engine's explicit budget (weights + KV pool), not free memory
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, n=1)
    ref = load_judge(str(judge_folder))
    ids = [ref.tokenizer.encode_prompt(TEMPLATE.format(prompt=s.prompt_text, response=s.response_text))
           for s in samples]
    try:
        want = score_judge(samples, **params)
        got = score_judge(samples, **params, engine="sglang", engine_options=sgl_options)
        sgl = load_judge(str(judge_folder), engine="sglang", engine_options=sgl_options)
        assert type(sgl.engine).__name__ == "SGLangEngine"  # built by the sglang plugin's own factory
        ref_ids = [s.response_ids for s in ref.engine.generate(ids, greedy)]
        sgl_ids = [s.response_ids for s in sgl.engine.generate(ids, greedy)]
    finally:
        for key in [k for k in _LOADED if k[0] == "judge" and k[4] == "sglang"]:
            _LOADED.pop(key).shutdown()
    # A greedy answer is decided only where its top two logits differ by more than fp32 can blur: each logit is a
    # chain of reductions of length hidden (32) over 2 layers and the head, each off by ~ eps * length * |logit|,
    # in either engine.
    margins, biggest = _greedy_margins(judge_folder, ids, ref_ids)
    tol = 4 * torch.finfo(torch.float32).eps * 32 * 3 * biggest
    decided = [i for i, m in enumerate(margins) if m > tol]
    verdicts = [w["score"] if isinstance(w, dict) else None for w in want]
    print(f"judge on sglang: {len(decided)}/{len(samples)} decided (smallest margin {min(margins):.2e}, tol "
          f"{tol:.1e}); verdicts {verdicts}")
    assert len(decided) >= 20, margins
    assert [sgl_ids[i] for i in decided] == [ref_ids[i] for i in decided]
    assert [got[i]["score"] if isinstance(got[i], dict) else None for i in decided] == [verdicts[i] for i in decided]
    assert len({v for v in verdicts if v is not None}) >= 3, verdicts  # not one constant answer


# ---- colocate = "rollout": the RM off the device while the engine generates ------------------------------------

@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory) -> Path:
    import torch
    from tiny_tokenizer import build_tokenizer_folder
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    out = build_tokenizer_folder(tmp_path_factory.mktemp("rm"))
    tok = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id, hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=64)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    return out


def rm_job(rm: Path, reward_model: str = 'colocate = "rollout"') -> str:
    return textwrap.dedent(f"""
        name = "rm-colocated"
        [data]
        source = "task:reverse"
        params = {{ min_len = 1, max_len = 5 }}
        [rollout]
        prompts_per_step = 3
        n_samples = 2
        max_new_tokens = 6
        [trainer]
        micro_batch_size = 6
        [reward]
        name = "reward_model"
        params = {{ path = "{rm}" }}
        [reward_model]
        path = "{rm}"
        {reward_model}
    """) + TINY_MODEL


def test_colocated_rm_is_off_the_device_while_the_engine_generates(rm_folder: Path, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    from milehpc.config.load import job_from_dict, read_toml
    from milehpc.rewards import model_scorers
    from milehpc.rewards.model_scorers import _LOADED, load_classifier, score_classifier
    from milehpc.rollout.reference import build_engine
    from milehpc.runtime.loop.colocated_reward import ColocatedScoring
    from milehpc.runtime.loop.rollout_metrics import rollout_metrics
    from milehpc.runtime.loop.rollout_side import RolloutSide

    (tmp_path / "job.toml").write_text(rm_job(rm_folder))
    job = job_from_dict(read_toml(tmp_path / "job.toml"), file=str(tmp_path / "job.toml"))
    _LOADED.clear()  # only this RM in the process (another test's judge would be released with it)
    request.addfinalizer(model_scorers._COLOCATED.clear)  # the process's flag: no later test inherits it
    engine = build_engine(job)
    side = RolloutSide(job, engine)
    assert isinstance(side.remote, ColocatedScoring)
    rm = load_classifier(str(rm_folder))  # loaded (and released) by the start-up warm-up
    full = sum(t.numel() * t.element_size() for t in rm.weights.host.values())
    held_while_generating: list[int] = []
    generate = engine.generate

    def watched(*args, **kwargs):
        held_while_generating.append(rm.weights.resident_bytes())
        return generate(*args, **kwargs)

    engine.generate = watched
    metrics = []
    for _ in range(2):
        groups, stats = side.produce()
        metrics.append(rollout_metrics(stats))
    assert list(side.remote.events) == ["generate", "onload", "score", "offload"] * 2
    assert full > 0 and held_while_generating == [0, 0], (full, held_while_generating)
    assert rm.weights.resident_bytes() == 0  # off the device again once it has scored
    assert all(m["reward/offloaded_gib"] == full / 2**30 and m["time/rm_onload"] >= 0 for m in metrics), metrics
    # an evaluation between steps scores with the RM put back, and leaves it off the device again
    from dataclasses import replace

    from milehpc.rollout.evaluate import Evaluator

    val = tmp_path / "val.jsonl"  # prompts of a file: scored by the job's reward, the RM
    val.write_text("".join(json.dumps({"prompt": f"rev:{n}=", "label": str(n)[::-1]}) + "\n" for n in (12, 345)))
    evaluator = Evaluator(replace(job, data=replace(job.data, val_source=str(val))), side.tokenizer)
    results = evaluator.run(engine)
    assert len(results) == 2 and all(r.greedy is not None and r.greedy != 0.0 for r in results), results
    assert rm.weights.resident_bytes() == 0
    # the restored RM scores as a fresh load does: every reward is the RM's own logit
    samples = [s for g in groups for s in g]
    _LOADED.clear()
    fresh = score_classifier(samples, path=str(rm_folder))
    assert [s.reward["rm_logit"] for s in samples] == [f["rm_logit"] for f in fresh]


def test_memory_counts_the_larger_of_kv_cache_and_colocated_rm_on_a_gpu(rm_folder: Path, tmp_path: Path) -> None:
    from milehpc import memory
    from milehpc.config.load import job_from_dict, read_toml

    job = tmp_path / "job.toml"
    job.write_text(rm_job(rm_folder))
    alone = tmp_path / "alone.toml"
    alone.write_text(rm_job(rm_folder).replace(f'[reward_model]\npath = "{rm_folder}"', "[reward_model]"))
    rm_bytes = sum(i.bytes for i in memory.reward_items(job_from_dict(read_toml(job)))[0])
    for site, offloaded in ((GPU_SITE, True), ("local", False)):
        data, base = (json.loads(_cli("plan", str(j), "--site", site, "--json").stdout) for j in (job, alone))
        rows = {r["item"]: r["bytes"] for r in data["memory"] if r["rank"] == "rollout"}
        without = {r["item"]: r["bytes"] for r in base["memory"] if r["rank"] == "rollout"}
        kv = without["KV cache"]
        if offloaded:  # the RM is off the device while generating; the reference engine frees its cache after
            assert rows["KV cache | reward model"] == max(kv, rm_bytes), rows
            assert rows["total"] == without["total"] - kv + max(kv, rm_bytes), (rows, without)
        else:  # a CPU: the RM's host copy is its weights
            assert rows["total"] == without["total"] + rm_bytes, (rows, without)
    assert min(kv, rm_bytes) > 0  # so the larger of the two is less than their sum
