"""Toy tasks, tokenizer, prompt sources (JSONL, seeded order, cursor) and the HDF5 rollout store."""

from __future__ import annotations

import json

import pytest

from milehpc.config.job import DataSpec
from milehpc.data.source import PromptSource, build_source, read_examples
from milehpc.data.tasks import addition_task, match_score, reverse_task, sort_task, toy_match, toy_permutation
from milehpc.data.tokenizer import CharTokenizer
from milehpc.errors import ConfigError, MilehpcError
from milehpc.samples import Sample, Status
from milehpc.samples.dumps import list_steps, read_rollouts, write_rollouts


def test_char_tokenizer_round_trip_and_specials() -> None:
    tok = CharTokenizer()
    ids = tok.encode("sort:31452=")
    assert tok.decode(ids) == "sort:31452="
    assert tok.encode_prompt("add:1+2=")[0] == tok.bos_id
    assert tok.decode([tok.bos_id, *tok.encode("12"), tok.eos_id, tok.pad_id]) == "12"
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    with pytest.raises(ValueError, match="not in the toy vocabulary"):
        tok.encode("é")


@pytest.mark.parametrize("make, check", [
    (sort_task, lambda p, lab: sorted(p[5:-1]) == list(lab)),
    (reverse_task, lambda p, lab: p[4:-1][::-1] == lab),
    (addition_task, lambda p, lab: sum(int(x) for x in p[4:-1].split("+")) == int(lab)),
])
def test_tasks_are_deterministic_and_correct(make, check) -> None:
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    assert [a[i] for i in range(20)] == [b[i] for i in range(20)]
    assert [a[i]["prompt"] for i in range(20)] != [c[i]["prompt"] for i in range(20)]
    for i in range(50):
        ex = a[i]
        assert ex["prompt"].endswith("=") and check(ex["prompt"], ex["label"])
        CharTokenizer().encode(ex["prompt"] + ex["label"])  # every character is in the toy vocabulary


def test_sort_lengths_follow_params() -> None:
    t = sort_task(min_len=2, max_len=3)
    assert {len(t[i]["label"]) for i in range(200)} == {2, 3}


def test_match_score_exact_and_partial() -> None:
    assert match_score("12345", "12345") == 1.0
    assert match_score(" 12345 ", "12345") == 1.0
    assert match_score("12355", "12345") == 0.0
    assert match_score("12355", "12345", partial=1.0) == pytest.approx(4 / 5)
    assert match_score("1234", "12345", partial=0.5) == pytest.approx(0.5 * 4 / 5)
    assert match_score("123456789", "12345", partial=1.0) == pytest.approx(5 / 9)  # padding is not rewarded
    assert toy_match(Sample(prompt_ids=[1], response_text="46", label="46")) == 1.0


def test_toy_permutation_checks_the_digits_not_their_order() -> None:
    def perm(response: str, label: str = "11234") -> float:
        return toy_permutation(Sample(prompt_ids=[1], response_text=response, label=label))

    assert perm("11234") == perm("43211") == perm(" 21143 ") == 1.0  # any order of the same digits
    assert perm("1234") == perm("112345") == perm("12234") == perm("") == 0.0  # one dropped, added or changed


def _source(tmp_path, rows, **kw):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path, build_source(DataSpec(source=str(path), **kw), CharTokenizer())


def test_jsonl_source_shuffles_per_epoch_with_seed(tmp_path) -> None:
    rows = [{"prompt": f"add:{i}+1=", "label": str(i + 1), "level": i % 3} for i in range(10)]
    _, src = _source(tmp_path, rows, seed=1)
    first = [p.text for p in src.take(10)]
    second = [p.text for p in src.take(10)]
    assert sorted(first) == sorted(second) == sorted(r["prompt"] for r in rows)  # each epoch visits all
    assert first != second  # a new permutation per epoch
    _, again = _source(tmp_path, rows, seed=1)
    assert [p.text for p in again.take(20)] == first + second
    _, other = _source(tmp_path, rows, seed=2)
    assert [p.text for p in other.take(10)] != first
    _, plain = _source(tmp_path, rows, shuffle=False)
    assert [p.text for p in plain.take(10)] == [r["prompt"] for r in rows]
    p = plain.peek(0)
    assert p.label == "1" and p.metadata == {"level": 0} and p.ids[0] == CharTokenizer().bos_id


def test_cursor_state_restores_the_exact_sequence(tmp_path) -> None:
    rows = [{"prompt": f"rev:{i}=", "label": str(i)[::-1]} for i in range(7)]
    _, src = _source(tmp_path, rows, seed=5)
    src.take(9)
    state = src.state_dict()
    expected = [p.text for p in src.take(12)]
    _, fresh = _source(tmp_path, rows, seed=5)
    fresh.load_state_dict(state)
    assert [p.text for p in fresh.take(12)] == expected
    _, small = _source(tmp_path, rows[:3], seed=5)
    with pytest.raises(ConfigError, match="data cursor"):
        small.load_state_dict(state)


def test_jsonl_errors_name_file_and_line(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match="line 2: invalid JSON") as err:
        read_examples(bad)
    assert str(bad) in str(err.value)
    bad.write_text('{"question": "a"}\n')
    with pytest.raises(ConfigError, match="line 1: no field 'prompt'"):
        read_examples(bad)
    with pytest.raises(ConfigError, match="not found"):
        read_examples(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="empty"):
        PromptSource([], CharTokenizer())


def test_task_source_via_plugin_validates_params() -> None:
    src = build_source(DataSpec(source="task:reverse", params={"min_len": 2, "max_len": 2}), CharTokenizer())
    p = src.take(1)[0]
    assert p.text.startswith("rev:") and len(p.label) == 2
    with pytest.raises(ConfigError, match="data.params.digits"):
        build_source(DataSpec(source="task:sort", params={"digits": 3}), CharTokenizer())
    with pytest.raises(MilehpcError, match="unknown task 'nope'"):
        build_source(DataSpec(source="task:nope"), CharTokenizer())


def test_hdf5_rollouts_round_trip(tmp_path) -> None:
    samples = [
        Sample(prompt_ids=[1, 5, 6], response_ids=[7, 8, 2], rollout_logprobs=[-0.5, -1.25, -0.125],
               loss_mask=[1, 0, 1], reward=1.0, group=4, index=32, weight_version=3, label="12",
               prompt_text="sort:21=", response_text="12", status=Status.COMPLETED,
               metadata={"turns": 2, "answer": "12"}, routed_experts=[[[0, 1]], [[1, 0]], [[0, 0]]]),
        Sample(prompt_ids=[1], response_ids=[], reward={"score": 0.25, "format": 1.0}, group=4, index=33,
               status=Status.FAILED, label=["a", "b"], metadata={"reward_error": "ValueError: x"}),
    ]
    write_rollouts(tmp_path, 7, samples, {"trainer_version": 4})
    got, attrs = read_rollouts(tmp_path, 7)
    assert attrs["step"] == 7 and attrs["trainer_version"] == 4
    assert [s.to_dict() for s in got] == [s.to_dict() for s in samples]
    assert list_steps(tmp_path) == [7]
    with pytest.raises(MilehpcError, match="have steps 7..7"):
        read_rollouts(tmp_path, 8)
