"""Vision-language prompts (issue 37): a tiny random Qwen2.5-VL built in code (tests/vl_models.py), verl's Parquet
layout with an images column read into image references, the rollout dumps holding references (not pixels), and
the reference engine and torch trainer agreeing on the logprobs of image prompts (vision tower trained or frozen)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from vl_models import IMAGE_SIZE, MERGE, PATCH  # noqa: E402

from milehpc.config.families import check_family, check_megatron_family  # noqa: E402
from milehpc.errors import ConfigError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
IMAGE_TOKENS = (IMAGE_SIZE // PATCH // MERGE) ** 2  # merged patches of one image: its placeholder tokens


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model folder and the example's Parquet prompts."""
    from vl_digits_data import write_task
    from vl_models import save_tiny_vl

    out = tmp_path_factory.mktemp("vl")
    save_tiny_vl(out / "model")
    write_task(out / "digits.parquet")
    return out


def _job(vl: Path, *overrides: str):  # noqa: ANN202
    from milehpc.config.load import load_job

    return load_job(REPO / "examples" / "vl_digits.toml", [
        f"model.path={vl / 'model'}", f"model.tokenizer={vl / 'model'}", f"data.source={vl / 'digits.parquet'}",
        *overrides])


def test_the_family_is_known_and_megatron_refuses_it(vl: Path) -> None:
    import transformers

    from milehpc.config.families import folder_model_type

    assert check_family(folder_model_type(vl / "model")).vision
    with pytest.raises(ConfigError, match="expected trainer.backend = 'torch' for a qwen2_5_vl model"):
        check_megatron_family("qwen2_5_vl")
    from milehpc.config.rules import check_job_rules

    with pytest.raises(ConfigError, match="expected trainer.dp = 1 for a vision-language model"):
        check_job_rules(_job(vl, "trainer.dp=2"))
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl / "model")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    proc = transformers.AutoProcessor.from_pretrained(vl / "model")
    assert proc.image_token == "<|image_pad|>"


def test_verl_parquet_images_become_references_and_dumps_hold_no_pixels(vl: Path, tmp_path: Path) -> None:
    from milehpc.data.images import IMAGES_KEY, image_bytes
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.samples import Sample
    from milehpc.samples.dumps import read_rollouts, rollout_path, write_rollouts

    job = _job(vl)
    tok = build_tokenizer(job.model.tokenizer)
    source = build_source(job.data, tok)
    prompts = source.take(6)
    for p in prompts:
        refs = p.metadata[IMAGES_KEY]
        assert len(refs) == 1 and refs[0].startswith("sha256:") and image_bytes(refs[0])[:4] == b"\x89PNG"
        # the processor's widening: one placeholder per merged patch, between the vision start and end tokens
        image_id = tok.tok.convert_tokens_to_ids("<|image_pad|>")
        assert p.ids.count(image_id) == IMAGE_TOKENS, p.ids
    samples = [Sample(prompt_ids=p.ids, response_ids=[5], rollout_logprobs=[-0.5], metadata=dict(p.metadata))
               for p in prompts for _ in range(4)]
    write_rollouts(tmp_path, 0, samples)
    back, _ = read_rollouts(tmp_path, 0)
    assert [s.metadata[IMAGES_KEY] for s in back] == [s.metadata[IMAGES_KEY] for s in samples]
    png = max(len(image_bytes(s.metadata[IMAGES_KEY][0])) for s in samples)
    assert png not in (0, None) and b"\x89PNG" not in rollout_path(tmp_path, 0).read_bytes()


def test_an_images_column_that_does_not_match_the_markers_is_one_line(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from vl_digits_data import digit_png

    from milehpc.data.source import read_examples

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "<image>a <image>b"}],
                                          "images": [{"bytes": digit_png(1, (3, 0)), "path": None}],
                                          "label": "1"}]), bad)
    with pytest.raises(ConfigError, match=r"row 0: the prompt has more image places than the 1 images"):
        read_examples(bad)


@pytest.mark.parametrize("freeze", [False, True])
def test_engine_and_trainer_logprobs_agree_on_image_prompts(vl: Path, freeze: bool) -> None:
    import torch

    from milehpc.data.images import IMAGES_KEY
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.reference import ReferenceEngine
    from milehpc.train.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    job = _job(vl, f"model.freeze_vision={str(freeze).lower()}")
    tok = build_tokenizer(job.model.tokenizer)
    trainer = TorchTrainer(job, tok)
    engine = ReferenceEngine(build_model(job.model, tok.vocab_size), tok, seed=1)
    prompts = build_source(job.data, tok).take(4)
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, images=[p.metadata[IMAGES_KEY] for p in prompts])
    samples = engine.generate([p.ids for p in prompts], sp)
    # fp32 logits of a 2-layer, 64-wide model over ~40 positions: float rounding is ~1e-6; 1e-3 is the bar
    # and far below what a wrong image, position or placeholder does (the tests saw ~1e-1 then).
    got = trainer.compute_logprobs(samples)
    worst = max(abs(a - b) for s, lp in zip(samples, got, strict=True) for a, b in zip(s.rollout_logprobs, lp,
                                                                                       strict=True))
    assert worst < 1e-3, worst
    names = [n for n, _ in trainer.export_weights()]
    assert any(n.startswith("model.language_model.") for n in names)
    assert any(n.startswith("model.visual.") for n in names) is not freeze
    trained = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert any(n.startswith("model.visual.") for n in trained) is not freeze


# ---- the example learns; its export answers as the engine did; an interrupted run resumes bitwise -----------------

@pytest.mark.slow(minutes=1)
def test_the_vl_example_learns_and_its_export_answers_like_the_engine(vl: Path, tmp_path: Path) -> None:
    import torch
    import transformers

    from milehpc.config.schema import to_dict
    from milehpc.data.images import IMAGES_KEY, load_image
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.export.run import export_run
    from milehpc.models import build_model
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.reference import ReferenceEngine
    from milehpc.runtime.loop import run_local

    torch.set_num_threads(1)
    job = _job(vl)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "job.json").write_text(json.dumps(to_dict(job)))  # as `milehpc submit` writes it
    history = run_local(job, tmp_path / "run", checkpointing=True)
    rewards = [h["rollout/reward_mean"] for h in history]
    # the warm-up leaves the policy reading some digits; RL takes the mean of the last 10 steps to the target
    assert rewards[0] < 0.6 and sum(rewards[-10:]) / 10 >= 0.8, rewards
    # every sync: engine and trainer logprobs of the tokens sampled by the weights the trainer holds agree
    assert max(h.get("train/logprob_diff_max", 0.0) for h in history) < 1e-3

    out = export_run(tmp_path / "run", tmp_path / "hf").out
    model = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    proc = transformers.AutoProcessor.from_pretrained(out)
    tok = build_tokenizer(job.model.tokenizer)
    engine = ReferenceEngine(build_model(job.model, tok.vocab_size), tok)
    engine.update_weights(model.state_dict().items(), 1)
    prompts = build_source(job.data, tok, seed_offset=7).take(12)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3, images=[p.metadata[IMAGES_KEY] for p in prompts])
    ours = [s.response_ids for s in engine.generate([p.ids for p in prompts], greedy)]
    theirs = []
    for p in prompts:
        enc = proc(text=[p.text], images=[load_image(r) for r in p.metadata[IMAGES_KEY]], return_tensors="pt")
        assert enc["input_ids"][0].tolist() == p.ids  # the processor tokenises the image prompt as the run did
        ids = model.generate(**enc, max_new_tokens=3, do_sample=False)[0, len(p.ids):].tolist()
        theirs.append(ids[: ids.index(tok.eos_id) + 1] if tok.eos_id in ids else ids)
    assert ours == theirs
    assert sum(tok.decode(r).strip() == str(p.label) for r, p in zip(ours, prompts, strict=True)) >= 8


def test_an_interrupted_vl_run_resumes_bitwise_equal(vl: Path, tmp_path: Path) -> None:
    import torch
    from local_interrupt import run_cut_and_resumed

    from milehpc.checkpoint import list_checkpoints
    from milehpc.runtime.loop import run_local

    torch.set_num_threads(1)
    # No warm-up (the rewards are all 0): an entropy bonus moves every weight each step, vision tower included.
    job = _job(vl, "run.steps=3", "trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4",
               "algorithm.entropy_coef=0.01", "run.target_reward=2.0")

    def final(run_dir: Path) -> dict[str, torch.Tensor]:
        newest = list_checkpoints(run_dir / "checkpoints")[0]
        state = torch.load(newest.path / "rank-00000.pt", weights_only=True)["state"]["trainer"]["trainer"]
        moments = {f"opt.{p}.{k}": v for p, d in state["optimizer"]["state"].items() for k, v in d.items()}
        return {**state["model"], **moments}

    steps = run_local(job, tmp_path / "whole", checkpointing=True)
    assert len(steps) == 3 and all(s["train/grad_norm"] > 0 for s in steps)
    run_cut_and_resumed(job, tmp_path / "cut", stop_after=1)
    want, got = final(tmp_path / "whole"), final(tmp_path / "cut")
    assert got.keys() == want.keys() and any(k.startswith("model.visual.") for k in got)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
