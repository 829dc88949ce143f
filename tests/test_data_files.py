"""Prompt files: JSONL, Parquet and datasets.save_to_disk folders read alike; verl's layout without conversion
(chat messages through the tokenizer's template, reward_model.ground_truth as the label, data_source kept);
field mapping by --set; length filtering with counts; one-line errors naming the file, the row and the field; the
shipped samples are what their script writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from required import require_module
from tiny_tokenizer import SAMPLES, build_tokenizer_folder

from milehpc.config.job import DataSpec
from milehpc.config.load import load_job
from milehpc.data.source import build_source, read_examples
from milehpc.data.tokenizer import CharTokenizer, HFTokenizer
from milehpc.errors import ConfigError

TRAIN = SAMPLES / "gsm8k_style_train"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer(str(build_tokenizer_folder(tmp_path_factory.mktemp("tok"))))


def _strip(examples: list[dict]) -> list[dict]:
    return [{k: v for k, v in ex.items() if k != "where"} for ex in examples]


def test_jsonl_parquet_and_a_saved_dataset_read_as_the_same_verl_examples(tmp_path: Path) -> None:
    datasets = require_module("datasets")
    rows = [json.loads(line) for line in TRAIN.with_suffix(".jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    from_jsonl = read_examples(TRAIN.with_suffix(".jsonl"))
    assert _strip(read_examples(TRAIN.with_suffix(".parquet"))) == _strip(from_jsonl)
    assert _strip(read_examples(tmp_path / "saved")) == _strip(from_jsonl)
    first = from_jsonl[0]
    assert first["label"] == rows[0]["reward_model"]["ground_truth"]  # verl's answer column, no mapping given
    assert first["prompt"] == rows[0]["prompt"]  # chat messages
    assert first["metadata"]["data_source"] == "gsm8k_style" and first["metadata"]["extra_info"]["index"] == 0
    # A DatasetDict folder names its splits.
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"DatasetDict folder: expected one split's folder.*splits: train"):
        read_examples(tmp_path / "dd")


def test_chat_messages_render_with_the_tokenizers_template(tok: HFTokenizer) -> None:
    src = build_source(DataSpec(source=str(TRAIN.with_suffix(".parquet")), shuffle=False), tok)
    p = src.peek(0)
    messages = read_examples(TRAIN.with_suffix(".parquet"))[0]["prompt"]
    reference = tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert p.ids == list(reference)
    assert p.text == f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert src.data_sources == {"gsm8k_style"}
    # Without a chat template (the toy tokenizer) messages are refused up front, naming the row.
    with pytest.raises(ConfigError, match=r"gsm8k_style_train.jsonl: model.tokenizer: line 1: the prompt is chat "
                                          "messages, but the tokenizer has no chat template"):
        build_source(DataSpec(source=str(TRAIN.with_suffix(".jsonl"))), CharTokenizer())


def test_field_mapping_by_set_reads_other_columns(tmp_path: Path, tok: HFTokenizer) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f'name = "m"\n[data]\nsource = "{TRAIN.with_suffix(".parquet")}"\n')
    spec = load_job(job, ["data.prompt_key=extra_info.question", "data.label_key=extra_info.answer"])
    src = build_source(spec.data, tok)
    rows = [json.loads(line) for line in TRAIN.with_suffix(".jsonl").read_text().splitlines()]
    p = src.peek(0)
    row = next(r for r in rows if r["extra_info"]["question"] == p.text)  # plain text: no template applied
    assert p.label == row["extra_info"]["answer"] and p.label.endswith(row["reward_model"]["ground_truth"])


def test_length_filter_drops_long_prompts_and_reports_counts(tok: HFTokenizer) -> None:
    path = TRAIN.with_suffix(".parquet")
    lengths = sorted(len(tok.encode_prompt(ex["prompt"])) for ex in read_examples(path))
    limit = lengths[len(lengths) // 2]
    longer = sum(n > limit for n in lengths)
    assert 0 < longer < len(lengths)
    src = build_source(DataSpec(source=str(path), max_prompt_tokens=limit), tok)
    assert len(src.examples) == len(lengths) - longer
    assert all(len(p.ids) <= limit for p in src.take(len(src.examples)))
    assert src.summary == (f"data: {len(lengths) - longer} train prompts from {path}; {longer} of {len(lengths)} "
                           f"dropped: longer than data.max_prompt_tokens = {limit} tokens")
    with pytest.raises(ConfigError, match=f"every one of the {len(lengths)} prompts is longer than "
                                          f"data.max_prompt_tokens = {lengths[0] - 1}"):
        build_source(DataSpec(source=str(path), max_prompt_tokens=lengths[0] - 1), tok)


def test_validation_split_reads_val_source_in_file_order(tok: HFTokenizer) -> None:
    val = SAMPLES / "gsm8k_style_val.parquet"
    src = build_source(DataSpec(source=str(TRAIN.with_suffix(".parquet")), val_source=str(val)), tok,
                       split="validation")
    rows = read_examples(val)
    assert [p.label for p in src.take(len(rows))] == [r["label"] for r in rows]  # no shuffle: file order
    with pytest.raises(ConfigError, match="data.val_source: no validation prompts"):
        build_source(DataSpec(source=str(val)), tok, split="validation")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_missing_field_is_one_line_naming_file_row_and_field(tmp_path: Path, suffix: str) -> None:
    rows = [json.loads(line) for line in TRAIN.with_suffix(".jsonl").read_text().splitlines()][:5]
    del rows[3]["reward_model"]["ground_truth"]
    path = tmp_path / f"bad{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(rows)  # the struct column keeps the key: a null marks the missing value
        pq.write_table(table.drop_columns(["reward_model"]).append_column(
            "reward_model", pa.array([r["reward_model"] if i != 3 else None for i, r in enumerate(rows)])), path)
    where = "line 4" if suffix == ".jsonl" else "row 3"
    with pytest.raises(ConfigError) as err:
        read_examples(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: data.label_key: {where}: no field 'reward_model.ground_truth'"), msg
    assert "\n" not in msg and err.value.exit_code == 2
    with pytest.raises(ConfigError, match=rf"{path}: data.prompt_key: line 1: no field 'question'|"
                                          rf"{path}: data.prompt_key: row 0: no field 'question'"):
        read_examples(path, prompt_key="question")


def test_a_first_row_without_its_answer_is_named_not_every_label_dropped(tmp_path: Path) -> None:
    """The answer column is chosen from every row, not the first alone: a first row that lacks it is an error naming
    that row (before: no labels at all for the whole file, silently)."""
    rows = [json.loads(line) for line in TRAIN.with_suffix(".jsonl").read_text().splitlines()][:4]
    del rows[0]["reward_model"]
    path = tmp_path / "first-row-bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"^{path}: data.label_key: line 1: no field 'reward_model.ground_truth'"):
        read_examples(path)


def test_the_shipped_samples_are_what_their_script_writes(tmp_path: Path) -> None:
    import importlib.util

    import pyarrow.parquet as pq

    spec = importlib.util.spec_from_file_location("make_samples", SAMPLES / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.write_samples(tmp_path)
    assert {p.name for p in written} == {p.name for p in SAMPLES.iterdir() if p.suffix in (".jsonl", ".parquet")}
    for path in written:
        shipped = SAMPLES / path.name
        if path.suffix == ".jsonl":
            assert path.read_text() == shipped.read_text(), path.name
        else:
            assert pq.read_table(path).equals(pq.read_table(shipped)), path.name
    math = read_examples(SAMPLES / "gsm8k_style_train.jsonl") + read_examples(SAMPLES / "gsm8k_style_val.jsonl")
    assert len(math) >= 36 and all(float(ex["label"]) == int(ex["label"]) for ex in math)  # numeric answers
    assert len(read_examples(SAMPLES / "code_style.jsonl")) >= 5


@pytest.mark.parametrize("damage", ["not-utf8", "state-json", "arrow-stream"])
def test_a_damaged_file_or_folder_is_one_line(tmp_path: Path, damage: str) -> None:
    """Not UTF-8, a broken state.json, a truncated Arrow file: one line naming the file and the field, exit 2."""
    if damage == "not-utf8":
        path = tmp_path / "latin1.jsonl"
        path.write_bytes('{"prompt": "caf\xe9", "label": "1"}\n'.encode("latin-1"))
    else:
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list([{"prompt": "1+1", "label": "2"}] * 3).save_to_disk(str(path))
        if damage == "state-json":
            (path / "state.json").write_text("{not json")
        else:
            arrow = next(path.glob("*.arrow"))
            arrow.write_bytes(arrow.read_bytes()[:40])
    with pytest.raises(ConfigError) as err:
        read_examples(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: data.source: cannot read the prompt data ("), msg
    assert "\n" not in msg and err.value.exit_code == 2
