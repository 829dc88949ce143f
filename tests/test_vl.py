"""Vision-language prompts (issue 37): tiny random Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE models built in code
(tests/vl_models.py), verl's Parquet layout with an images column read into image references, the rollout dumps
holding references (not pixels), a byte-bounded pixel cache, the vision tower in the memory estimate, the reference
engine and torch trainer agreeing on the logprobs of image prompts (vision tower trained or frozen; Qwen3-VL's
deepstack features), the example learning through MPI ranks, and exports that answer like the engine."""

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
    # multi-turn and tool generators re-render their history without the image parts: refused on the login node
    with pytest.raises(ConfigError, match="expected no rollout.generator for a vision-language model "
                                          r"\(qwen2_5_vl: .*\), got 'toy_retry'"):
        check_job_rules(_job(vl, "rollout.generator=toy_retry"))
    # vLLM: refused with the measured reason (README's VL section), not silently run without the images; SGLang
    # serves this family (tests/test_sglang_vl.py; Qwen3-VL's refusal: tests/test_config_rules.py)
    with pytest.raises(ConfigError, match=r"expected rollout.engine = 'reference' or 'sglang' for a qwen2_5_vl model "
                                          r"\(images in the prompts; .*vllm adapter sends token ids alone .*\), got "
                                          r"'vllm'"):
        check_job_rules(_job(vl, "rollout.engine=vllm"))
    check_job_rules(_job(vl, "rollout.engine=sglang"))
    assert all(check_family(t).vision for t in ("qwen3_vl", "qwen3_vl_moe"))
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


def test_processed_pixels_are_cached_within_a_byte_budget(vl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Least recently used out first, never over the budget; an entry over the budget alone is not kept; reading
    the prompts processes no pixels (the placeholder counts come from the images' sizes); the module's cache holds
    what pixels() processed (its bytes are the tensors')."""
    import torch

    from milehpc.data import images
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer

    lru = images.ByteLRU(1000)
    for key in "ab":
        lru.put(key, (torch.zeros(100), torch.zeros(0)))  # 400 bytes each
    assert lru.get("a") is not None  # a is now the most recently used: b goes first
    lru.put("c", torch.zeros(100))
    assert (lru.get("b"), len(lru), lru.bytes) == (None, 2, 800) and lru.get("a") is not None
    lru.put("big", torch.zeros(300))  # 1200 bytes: over the budget alone, kept out, nothing evicted for it
    assert (lru.get("big"), len(lru), lru.bytes) == (None, 2, 800)
    monkeypatch.setattr(images, "_PIXELS", images.ByteLRU(images.PIXEL_CACHE_BYTES))
    job = _job(vl)
    ref = build_source(job.data, build_tokenizer(job.model.tokenizer)).take(1)[0].metadata[images.IMAGES_KEY][0]
    assert len(images._PIXELS) == 0
    rows, grid = images.pixels(str(vl / "model"), ref)
    assert images._PIXELS.get(ref)[0] is rows and images._PIXELS.budget == images.PIXEL_CACHE_BYTES
    assert rows.nbytes + grid.nbytes <= images._PIXELS.bytes <= images.PIXEL_CACHE_BYTES


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


def test_images_by_path_or_in_message_parts_are_read_alike_and_a_non_image_is_one_line(tmp_path: Path) -> None:
    """verl's images column of paths (relative to the file) and chat messages with inline image parts read as the
    same messages and reference as the bytes themselves; a file that is no image is one error naming its row, when
    the prompts are read (not a Pillow traceback on a rank at its first forward)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from vl_digits_data import digit_png

    from milehpc.data.images import IMAGES_KEY, reference
    from milehpc.data.source import read_examples

    png = digit_png(3, (4, 1))
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "3.png").write_bytes(png)
    column = tmp_path / "paths.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "<image>what?"}],
                                          "images": ["img/3.png"], "label": "3"}]), column)
    parts = tmp_path / "parts.jsonl"
    parts.write_text(json.dumps({"prompt": [{"role": "user", "content": [{"type": "image", "image": "img/3.png"},
                                                                          {"type": "text", "text": "what?"}]}],
                                 "label": "3"}) + "\n")
    for source in (column, parts):
        (row,) = read_examples(source)
        assert row["metadata"][IMAGES_KEY] == [reference(png)], source
        assert row["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    (tmp_path / "img" / "3.png").write_bytes(b"not an image")
    for source, where in ((column, "row 0"), (parts, "line 1")):
        with pytest.raises(ConfigError, match=rf"{where}: expected an encoded image \(PNG, JPEG, \.\.\.\), got "
                                              r"'img/3.png' 12 bytes that Pillow cannot read"):
            read_examples(source)


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


def _tower(job) -> list[int]:  # noqa: ANN001
    """The vision tower's tensor sizes as the login-side estimate reads them from config.json."""
    from milehpc import memory

    return sorted(memory.model_shape(job)[0].vision_tower)


def test_the_memory_estimate_counts_the_vision_tower(vl: Path) -> None:
    """The LM's shape is config.json's text_config; the vision tower is a row of plan's memory table, in the
    engine's weights, and in the trainer's gradients and Adam moments unless model.freeze_vision: each figure is
    the tiny model's own count of elements (fp32)."""
    import transformers
    from click.testing import CliRunner

    from milehpc import memory
    from milehpc.cli import cli
    from milehpc.models_vl import vision_parameter

    model = transformers.AutoModelForImageTextToText.from_pretrained(vl / "model")
    every = sum(p.numel() for p in model.parameters())
    assert _tower(_job(vl)) == sorted(p.numel() for p in model.model.visual.parameters())
    for freeze in (False, True):
        job = _job(vl, f"model.freeze_vision={str(freeze).lower()}")
        items = {i.name: i.bytes for i in memory.trainer_items(job, memory.model_shape(job)[0])[0]}
        assert items["trainer parameters"] + items["vision tower"] == 4 * every
        trained = sum(p.numel() for n, p in model.named_parameters() if not (freeze and vision_parameter(n)))
        assert items["trainer gradients"] == 4 * trained
    res = CliRunner().invoke(cli, ["plan", str(REPO / "examples" / "vl_digits.toml"), "--site", "local", "--json",
                                   "--set", f"model.path={vl / 'model'}", "--set", f"model.tokenizer={vl / 'model'}",
                                   "--set", f"data.source={vl / 'digits.parquet'}"])
    assert res.exit_code == 0, res.output
    rows = {(r["rank"], r["item"]): r for r in json.loads(res.output)["memory"]}
    assert rows[("trainer", "vision tower")]["bytes"] == 4 * sum(p.numel() for p in model.model.visual.parameters())
    assert rows[("rollout", "engine weights")]["bytes"] == 4 * every


# ---- the example learns; its export answers as the engine did; an interrupted run resumes bitwise -----------------

@pytest.mark.mpi
@pytest.mark.slow(minutes=1)
def test_the_vl_example_learns_on_mpi_ranks_and_its_export_answers_like_the_engine(vl: Path, tmp_path: Path) -> None:
    """The example as shipped through `milehpc run --site local` (mpirun: 1 rollout rank with the reference engine,
    1 torch trainer rank, the weights, vision tower included, broadcast over gloo after each step)."""
    from test_loop_mpi import run_cli

    from milehpc.export.run import export_run

    sets = [f"model.path={vl / 'model'}", f"model.tokenizer={vl / 'model'}", f"data.source={vl / 'digits.parquet'}"]
    example = REPO / "examples" / "vl_digits.toml"
    records = run_cli(tmp_path, example, timeout=600, args=[a for s in sets for a in ("--set", s)])
    first = records[0]
    assert (first["dist/mpi_world_size"], first["dist/trainer_world_size"], first["dist/rollout_ranks"]) == (2, 1, 1)
    rewards = [r["rollout/reward_mean"] for r in records]
    # the warm-up leaves the policy reading some digits; RL takes the mean of the last 10 steps to the target
    assert rewards[0] < 0.6 and sum(rewards[-10:]) / 10 >= 0.8, rewards
    # after each sync the trainer's logprobs of what the engine sampled with the synced weights agree (fp32, 2 layers
    # of 64 over ~15 tokens: rounding ~1e-6; a weight the sync missed or a wrong position moves them by ~1e-1)
    assert all(r["train/logprob_diff_max"] < 1e-3 for r in records), [r["train/logprob_diff_max"] for r in records]

    out = export_run(tmp_path / "run", tmp_path / "hf").out
    ours, prompts, tok = export_answers_like_the_engine(_job(vl), out, prompts=12)
    assert sum(tok.decode(r).strip() == str(p.label) for r, p in zip(ours, prompts, strict=True)) >= 8


def run_with_job_file(job, run_dir: Path) -> list[dict[str, float]]:  # noqa: ANN001
    """``run_local`` with checkpoints in ``run_dir``, whose job.json is written as ``milehpc submit`` writes it."""
    from milehpc.config.schema import to_dict
    from milehpc.runtime.loop import run_local

    run_dir.mkdir()
    (run_dir / "job.json").write_text(json.dumps(to_dict(job)))
    return run_local(job, run_dir, checkpointing=True)


def export_answers_like_the_engine(job, out: Path, *, prompts: int):  # noqa: ANN001, ANN202
    """The exported folder, loaded with transformers' image-text-to-text class and the processor, greedily answers
    ``prompts`` held-out prompts as the reference engine holding its weights does; returns (the engine's answers,
    the prompts, the tokenizer)."""
    import transformers

    from milehpc.config.families import check_family, folder_model_type
    from milehpc.data.images import IMAGES_KEY, load_image
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.reference import ReferenceEngine

    model = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(model).__name__ == check_family(folder_model_type(job.model.path)).causal_lm  # the family's class
    proc = transformers.AutoProcessor.from_pretrained(out)
    tok = build_tokenizer(job.model.tokenizer)
    engine = ReferenceEngine(build_model(job.model, tok.vocab_size), tok)
    engine.update_weights(model.state_dict().items(), 1)
    shown = build_source(job.data, tok, seed_offset=7).take(prompts)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3, images=[p.metadata[IMAGES_KEY] for p in shown])
    ours = [s.response_ids for s in engine.generate([p.ids for p in shown], greedy)]
    theirs = []
    for p in shown:
        enc = proc(text=[p.text], images=[load_image(r) for r in p.metadata[IMAGES_KEY]], return_tensors="pt")
        assert enc["input_ids"][0].tolist() == p.ids  # the processor tokenises the image prompt as the run did
        ids = model.generate(**enc, max_new_tokens=3, do_sample=False)[0, len(p.ids):].tolist()
        theirs.append(ids[: ids.index(tok.eos_id) + 1] if tok.eos_id in ids else ids)
    assert ours == theirs
    return ours, shown, tok


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_syncs_agree_and_its_export_answers_like_the_engine(vl: Path, tmp_path: Path, family: str) -> None:
    """Qwen3-VL (and its MoE sibling): deepstack features of the vision blocks added to the first LM layers at the
    image places. Engine and trainer could agree while both leave them out; transformers' own forward over the
    processor's inputs (the exported folder's greedy answers) cannot."""
    import torch
    from vl_models import save_tiny_vl

    from milehpc.export.run import export_run

    torch.set_num_threads(1)
    model = save_tiny_vl(tmp_path / "model", family=family)
    # No warm-up, rewards all 0: the entropy bonus moves every weight, so each sync sends new weights.
    job = _job(vl, f"model.path={tmp_path / 'model'}", f"model.tokenizer={tmp_path / 'model'}", "run.steps=2",
               "trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.n_samples=2",
               "algorithm.entropy_coef=0.01", "run.target_reward=2.0")
    # the memory estimate's vision tower (deepstack mergers, position grid) is the model's, tensor by tensor
    assert _tower(job) == sorted(p.numel() for p in model.model.visual.parameters())
    history = run_with_job_file(job, tmp_path / "run")
    # after each sync the engine's logprobs of its samples are the trainer's (fp32, 2 layers of 64 over ~15 tokens:
    # rounding ~1e-6; a lost deepstack feature or position moves them by ~1e-1)
    assert len(history) == 2 and all(h["train/grad_norm"] > 0 for h in history)
    assert max(h["train/logprob_diff_max"] for h in history) < 1e-3, history
    export_answers_like_the_engine(job, export_run(tmp_path / "run", tmp_path / "hf").out, prompts=6)


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
