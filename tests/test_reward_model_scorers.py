"""Model rewards in process (issue 35 item 2): the classifier RM (``reward_model``: HF sequence classifier from a
local folder, chat template, batches, normalisation) and the generative judge (``judge``: the reference engine,
template, answer parser), combined with rule rewards (weights, gate); scoring that fails is retried, then the sample
fails and is counted, never scored 0. Tiny random models built here; one forward pass is a few ms."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from milehpc.config.job import RewardSpec
from milehpc.errors import ConfigError
from milehpc.rewards import model_scorers as ms
from milehpc.rewards.api import RewardRunner
from milehpc.rollout import judge as jd
from milehpc.samples import Sample, Status

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sort_rm", ROOT / "examples" / "sort_rm.py")
sort_rm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sort_rm)


def qwen2_rm_config(vocab_size: int) -> Any:
    """A 2-layer, 32-wide Qwen2 classifier (the example's RM is GPT-2: these tests keep a RoPE model)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32, pad_token_id=0,
                       eos_token_id=2, bos_token_id=None, num_labels=1)


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory) -> Path:
    """A random-init RM with the example's character tokenizer (no chat template)."""
    from transformers import Qwen2ForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    tok = sort_rm.save_tokenizer(out)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(qwen2_rm_config(len(tok))).save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _fresh_models():
    ms._LOADED.clear()  # a test's monkeypatched model must not leak into the next
    yield
    ms._LOADED.clear()


def samples(answers: list[str], prompt: str = "sort:4321=", label: str = "1234") -> list[Sample]:
    return [Sample(prompt_ids=[1], response_ids=[3] * len(a), prompt_text=prompt, response_text=a, label=label,
                   index=i) for i, a in enumerate(answers)]


def direct_logits(folder: Path, texts: list[str]) -> list[float]:
    """Each text alone through transformers, no padding: what a batched score must equal."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


def test_classifier_batches_score_as_each_sample_alone(rm_folder: Path) -> None:
    answers = ["4321", "43", "432100", "1", "4312"]  # different lengths: padded batches
    want = direct_logits(rm_folder, ["sort:4321=" + a for a in answers])
    got = ms.score_classifier(samples(answers), path=str(rm_folder), batch_size=2)
    # fp32 rounding of a 2-layer, 32-wide forward pass, padded vs not: a few eps x the logits' magnitude x depth
    tol = 64 * torch.finfo(torch.float32).eps * max(1.0, max(map(abs, want)))
    assert [v["rm_logit"] for v in got] == pytest.approx(want, abs=tol)
    assert [v["score"] for v in got] == [v["rm_logit"] for v in got]  # normalize = none
    assert len({round(w, 4) for w in want}) == len(want)  # the texts are told apart: a real comparison
    sig = ms.score_classifier(samples(answers), path=str(rm_folder), normalize="sigmoid")
    assert [v["score"] for v in sig] == pytest.approx([1 / (1 + math.exp(-w)) for w in want], abs=tol)
    std = ms.score_classifier(samples(answers), path=str(rm_folder), normalize="standard", mean=0.5, std=2.0)
    assert [v["score"] for v in std] == pytest.approx([(w - 0.5) / 2.0 for w in want], abs=tol)


def test_classifier_applies_the_rm_chat_template(tmp_path: Path) -> None:
    from transformers import Qwen2ForSequenceClassification

    from tests.tiny_tokenizer import build_tokenizer_folder

    build_tokenizer_folder(tmp_path, vocab_size=300)
    torch.manual_seed(0)
    config = qwen2_rm_config(300)
    config.pad_token_id = 0
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    rm = ms.load_classifier(str(tmp_path))
    text = rm.text("What is 2+2?", "4", chat_template=True)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert rm.text("What is 2+2?", "4", chat_template=False) == "What is 2+2?4"
    [got] = ms.score_classifier(samples(["4"], prompt="What is 2+2?"), path=str(tmp_path))
    assert got["rm_logit"] == pytest.approx(direct_logits(tmp_path, [text])[0], abs=1e-5)


def test_failed_rm_batches_are_retried_then_failed_never_zero(rm_folder: Path, monkeypatch) -> None:
    calls = []
    real = ms.ClassifierRM.logits

    def flaky(self, texts, **kw):
        calls.append(len(texts))
        if len(calls) == 1:
            raise RuntimeError("out of memory (first try)")
        return real(self, texts, **kw)

    monkeypatch.setattr(ms.ClassifierRM, "logits", flaky)
    got = ms.score_classifier(samples(["4321", "1234"]), path=str(rm_folder), retries=1)
    assert calls == [2, 2] and [v["rm_retries"] for v in got] == [1.0, 1.0]

    def broken(self, texts, **kw):
        raise RuntimeError("the RM's device is gone")

    monkeypatch.setattr(ms.ClassifierRM, "logits", broken)
    runner = RewardRunner.from_spec(RewardSpec(name="reward_model", params={"path": str(rm_folder), "retries": 2}))
    batch = samples(["4321", "1234", "99"])
    metrics = runner.score(batch)
    assert metrics["reward/failed"] == 3 and metrics["reward/count"] == 0
    for s in batch:  # dropped and counted: no made-up score
        assert s.status is Status.FAILED and s.reward is None and "device is gone" in s.metadata["reward_error"]


def test_rm_timeout_fails_the_samples(rm_folder: Path, monkeypatch) -> None:
    import time

    monkeypatch.setattr(ms.ClassifierRM, "logits", lambda self, texts, **kw: time.sleep(0.5) or [0.0] * len(texts))
    runner = RewardRunner.from_spec(RewardSpec(name="reward_model", params={"path": str(rm_folder)}, timeout_s=0.05))
    batch = samples(["4321"])
    assert runner.score(batch)["reward/failed"] == 1
    assert batch[0].status is Status.FAILED and batch[0].reward is None and "longer than" in batch[0].metadata[
        "reward_error"]


def test_missing_rm_folder_is_one_line_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"reward\.params\.path: expected a local model folder"):
        RewardRunner.from_spec(RewardSpec(name="reward_model", params={"path": str(tmp_path / "nope")}))


# -- the generative judge -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory) -> Path:
    """A causal LM (toy vocabulary) that answers "7" to everything: every layer's output projection is zero, so the
    last hidden state is the (shared) token embedding, and only the "7" row of the head points along it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from milehpc.data.tokenizer import CharTokenizer

    tok = CharTokenizer()
    config = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, max_position_embeddings=128, pad_token_id=0,
                         eos_token_id=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = torch.ones(16)
        model.model.embed_tokens.weight.copy_(e.expand_as(model.model.embed_tokens.weight))
        model.lm_head.weight.copy_(-e.expand_as(model.lm_head.weight))
        model.lm_head.weight[tok.stoi["7"]] = e
    out = tmp_path_factory.mktemp("judge")
    model.save_pretrained(out)
    return out


def test_judge_fills_the_template_and_parses_the_grade(judge_folder: Path, monkeypatch) -> None:
    seen = []
    real = jd.Judge.answers

    def spy(self, prompts, **kw):
        seen.extend(prompts)
        return real(self, prompts, **kw)

    monkeypatch.setattr(jd.Judge, "answers", spy)
    got = jd.score_judge(samples(["4321", "12"]), path=str(judge_folder), tokenizer="toy",
                         template="q:{prompt} a:{response} r:{label}? ", max_new_tokens=1, scale=10.0)
    assert seen == ["q:sort:4321= a:4321 r:1234? ", "q:sort:4321= a:12 r:1234? "]
    assert [v["score"] for v in got] == [0.7, 0.7] and [v["judge_answer"] for v in got] == [7.0, 7.0]


def test_judge_asks_again_then_fails_unparsed_answers(judge_folder: Path, monkeypatch) -> None:
    temps = []

    def answers(self, prompts, *, temperature, **kw):
        temps.append(temperature)
        return ["unsure" if p.endswith("x") or len(temps) == 1 else "yes" for p in prompts]

    monkeypatch.setattr(jd.Judge, "answers", answers)
    got = jd.score_judge(samples(["4321", "x"]), path=str(judge_folder), tokenizer="toy", answer_pattern="(yes|no)",
                         answer_map={"yes": 1.0, "no": 0.0}, retries=2, retry_temperature=0.7)
    assert temps == [0.0, 0.7, 0.7]  # greedy first, then sampled
    assert got[0] == {"score": 1.0, "judge_answer": 1.0, "judge_retries": 1.0}
    assert isinstance(got[1], RuntimeError) and "no grade in 3 tries" in str(got[1])


def test_parse_answer() -> None:
    assert ms.parse_answer("grade: 8/10", r"(\d+)/10", {}, 10.0) == 0.8
    assert ms.parse_answer("Verdict: YES", r"(YES|NO)", {"YES": 1.0, "NO": 0.0}) == 1.0
    assert ms.parse_answer("Verdict: maybe", r"(YES|NO)", {"YES": 1.0}) is None
    assert ms.parse_answer("nan", r"(\w+)", {}) is None  # not a finite number: no grade, not a made-up one


def test_judge_template_fields_are_checked() -> None:
    from milehpc import plugins
    from milehpc.config.schema import check_params

    spec = plugins.lookup("reward", "judge")
    with pytest.raises(ConfigError, match=r"reward\.params\.template: unknown field \{answer\}"):
        check_params(spec, {"path": "j", "template": "{answer} {response}"}, file=None, prefix="reward.params")
    with pytest.raises(ConfigError, match=r"reward\.params\.template: expected the field \{response\}"):
        check_params(spec, {"path": "j", "template": "{prompt}"}, file=None, prefix="reward.params")


def test_combine_gates_the_judge_on_the_format_and_never_zeroes_a_failure(judge_folder: Path, monkeypatch) -> None:
    asked = []
    real = jd.Judge.answers

    def spy(self, prompts, **kw):
        asked.extend(prompts)
        return real(self, prompts, **kw)

    monkeypatch.setattr(jd.Judge, "answers", spy)
    judge = {"name": "judge", "weight": 2.0, "gate": "exact_match",
             "params": {"path": str(judge_folder), "tokenizer": "toy", "template": "{response}:", "max_new_tokens": 1,
                        "scale": 10.0}}
    spec = RewardSpec(name="combine", params={"rewards": [{"name": "exact_match"}, judge]})
    batch = samples(["1234", "4321", "1234"])
    RewardRunner.from_spec(spec).score(batch)
    assert asked == ["1234:", "1234:"]  # only where the gate scored
    assert [s.reward for s in batch] == [
        {"score": 1.0 + 2 * 0.7, "exact_match": 1.0, "judge": 0.7},
        {"score": 0.0, "exact_match": 0.0, "judge": 0.0},
        {"score": 1.0 + 2 * 0.7, "exact_match": 1.0, "judge": 0.7}]
    monkeypatch.setattr(jd.Judge, "answers", lambda self, prompts, **kw: ["?"] * len(prompts))
    batch = samples(["1234", "4321"])
    metrics = RewardRunner.from_spec(spec).score(batch)
    assert batch[0].status is Status.FAILED and batch[0].reward is None  # the judge failed it: not 1 + 0
    assert batch[1].reward == {"score": 0.0, "exact_match": 0.0, "judge": 0.0}  # not asked: the gate's 0
    assert metrics["reward/failed"] == 1


def test_combine_gate_must_name_an_earlier_reward() -> None:
    from milehpc import plugins
    from milehpc.config.schema import check_params

    parts = [{"name": "exact_match", "gate": "format"}, {"name": "format"}]
    with pytest.raises(ConfigError, match=r"reward\.params\.rewards\[0\]\.gate: expected an earlier reward"):
        check_params(plugins.lookup("reward", "combine"), {"rewards": parts}, file=None, prefix="reward.params")


def test_reward_parts_are_reported_beside_the_reward() -> None:
    """A dict reward's parts (combine's, a model's raw output) become reward/<part> means over the scored samples of
    all engines (a failed sample has no reward and does not count)."""
    from milehpc.runtime.loop.rollout_metrics import PART, merge_rollout_stats, new_stats, rollout_metrics

    one, two = new_stats(), new_stats()
    one.update({"scored": 3, "reward_sum": 2.4, f"{PART}toy_match": 1.0, f"{PART}reward_model": 2.4})
    two.update({"scored": 1, "reward_sum": 0.9, f"{PART}toy_match": 1.0, f"{PART}reward_model": 0.9})
    metrics = rollout_metrics(merge_rollout_stats([one, two]))
    assert metrics["reward/toy_match"] == pytest.approx(0.5) and metrics["reward/reward_model"] == pytest.approx(0.825)
    assert metrics["rollout/reward_mean"] == pytest.approx(metrics["reward/reward_model"])
