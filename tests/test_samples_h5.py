"""The one HDF5 codec of samples (milehpc/samples/h5.py): exact and compact round trips, groups of samples, the
previous checkpoint layout, the dump layout that HDF5 tools read, and that no other HDF5 writer of samples exists."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from milehpc.errors import RuntimeFailure
from milehpc.samples import Sample, Status
from milehpc.samples import h5 as codec
from milehpc.samples.dumps import read_rollouts, write_rollouts
from milehpc.samples.h5 import read_samples, read_samples_h5, write_samples, write_samples_h5

REPO = Path(__file__).resolve().parents[1]


def _awkward() -> list[Sample]:
    return [
        Sample(prompt_ids=[1, 2**40, 0], response_ids=[7, 8, 2],
               rollout_logprobs=[0.1 + 0.2, -1e-300, -(1 / 3)], loss_mask=[1, 0, 1],
               reward={"score": 0.1 + 0.2, "format": -1e-300, "parts": 3.0}, group=2**40, index=-1,
               weight_version=7, label={"answer": [1, 2.5, None, "ü"], "nested": {"k": [[]]}},
               prompt_text="sort:21= \u00e9\u4e2d\U0001f600\n\t\"q\"", response_text="12",
               metadata={"turns": [{"role": "tool", "text": "?1=", "ok": True}], "answer": None, "x": 5e-324},
               routed_experts=[[[0, 3], [1, 2]], [[4, 5], [6, 7]], [[0, 1], [2, 3]]]),
        Sample(prompt_ids=[1], status=Status.FAILED, reward=None, label=None,
               metadata={"reward_error": "ValueError: boom"}),  # empty response, no reward
        Sample(prompt_ids=[3, 4], response_ids=[5], rollout_logprobs=[-0.0], status=Status.ABORTED,
               reward=-2.5, label=("tu", "ple"), routed_experts=[], response_text="a\x00b\ud800c"),
        Sample(prompt_ids=[], status=Status.TRUNCATED, reward=1, prompt_text="", response_text=""),
    ]


def _as_read(s: Sample) -> Sample:
    """What JSON gives back: tuples come back as lists; everything else is unchanged."""
    return dataclasses.replace(s, label=json.loads(json.dumps(s.label)))


def test_the_codec_covers_every_sample_field() -> None:
    stored = {*codec.RAGGED, *codec.SCALARS, *codec.TEXTS, *(attr for attr, _ in codec.JSONS.values())}
    assert stored == {f.name for f in dataclasses.fields(Sample)}


def test_exact_mode_round_trips_awkward_samples_bit_for_bit(tmp_path: Path) -> None:
    samples = _awkward()
    with h5py.File(tmp_path / "s.h5", "w") as f:
        write_samples(f.create_group("g"), samples)
    with h5py.File(tmp_path / "s.h5", "r") as f:
        g = f["g"]
        assert g["prompt_ids"].dtype == np.int64 and g["rollout_logprobs"].dtype == np.float64
        got = read_samples(g)
    assert got == [_as_read(s) for s in samples]  # dataclass equality: every field, floats compared exactly
    assert [x.hex() for x in got[0].rollout_logprobs] == [x.hex() for x in samples[0].rollout_logprobs]
    assert got[2].response_text == "a\x00b\ud800c" and got[0].metadata["x"] == 5e-324
    assert [s.status for s in got] == [Status.COMPLETED, Status.FAILED, Status.ABORTED, Status.TRUNCATED]
    assert isinstance(got[3].reward, int) and got[1].metadata == {"reward_error": "ValueError: boom"}


def test_compact_mode_keeps_ids_and_rounds_logprobs_to_float32(tmp_path: Path) -> None:
    samples = [s for s in _awkward() if max(s.prompt_ids, default=0) < 2**31]
    with h5py.File(tmp_path / "s.h5", "w") as f:
        write_samples(f, samples, compact=True)
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f["prompt_ids"].dtype == np.int32 and f["response_ids"].dtype == np.int32
        assert f["rollout_logprobs"].dtype == np.float32 and f["reward"].dtype == np.float32
        got = read_samples(f)
    assert [s.prompt_ids for s in got] == [s.prompt_ids for s in samples]
    assert [s.response_ids for s in got] == [s.response_ids for s in samples]
    for a, b in zip(got, samples, strict=True):
        assert a.rollout_logprobs == [float(np.float32(x)) for x in b.rollout_logprobs]
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, rel=2**-23, abs=1e-38)
        # everything else is exact: rewards come from reward_detail (JSON), not the float32 ``reward`` column
        assert dataclasses.replace(a, rollout_logprobs=b.rollout_logprobs) == _as_read(b)


def test_named_buffers_file_keeps_groups_flat_lists_and_empties(tmp_path: Path) -> None:
    samples = [_as_read(s) for s in _awkward()]
    buffers = {"carry": samples[:2], "ready": [samples[2:], [], samples[:1]], "outbox_B": [], "empty_groups": [[]]}
    write_samples_h5(tmp_path / "b.h5", buffers)
    assert read_samples_h5(tmp_path / "b.h5") == buffers
    with h5py.File(tmp_path / "b.h5", "r") as f:
        assert f["ready"]["group_sizes"][()].tolist() == [2, 0, 1] and "group_sizes" not in f["carry"]


def test_reads_the_previous_checkpoint_layout(tmp_path: Path) -> None:
    """Checkpoints of the previous release: ``count`` attr, int64/float64 ragged, ``status`` strings and one ``extra``
    JSON per sample with reward/label/texts/metadata/routed_experts; no text, reward or JSON datasets."""
    samples = _awkward()[:2] + [_awkward()[3]]
    strings = h5py.string_dtype()
    with h5py.File(tmp_path / "old.h5", "w") as f:
        for name, buffer, sizes in (("carry", samples, None), ("ready", samples, [1, 2])):
            g = f.create_group(name)
            g.attrs["count"] = len(buffer)
            if sizes:
                g.create_dataset("group_sizes", data=np.asarray(sizes, dtype=np.int64))
            for key, dtype in (("prompt_ids", "int64"), ("response_ids", "int64"), ("rollout_logprobs", "float64"),
                               ("loss_mask", "int8")):
                rows = [getattr(s, key) for s in buffer]
                g.create_dataset(key, data=np.asarray([x for r in rows for x in r], dtype=dtype))
                g.create_dataset(f"{key}_offsets", data=np.cumsum([0, *map(len, rows)]).astype(np.int64))
            for key in ("group", "index", "weight_version"):
                g.create_dataset(key, data=np.asarray([getattr(s, key) for s in buffer], dtype=np.int64))
            g.create_dataset("status", data=[s.status.value for s in buffer], dtype=strings)
            g.create_dataset("extra", dtype=strings, data=[json.dumps({k: getattr(s, k) for k in (
                "reward", "label", "prompt_text", "response_text", "metadata", "routed_experts")}) for s in buffer])
    got = read_samples_h5(tmp_path / "old.h5")
    assert got == {"carry": samples, "ready": [samples[:1], samples[1:]]}


def test_reads_a_dump_of_the_previous_release_without_metadata(tmp_path: Path) -> None:
    samples = [s for s in _awkward() if max(s.prompt_ids, default=0) < 2**31]
    path = write_rollouts(tmp_path, 3, samples)
    with h5py.File(path, "a") as f:
        del f["metadata"], f["routed_experts"]
    got, _ = read_rollouts(tmp_path, 3)
    assert [s.metadata for s in got] == [{}] * len(samples) and {s.routed_experts for s in got} == {None}
    assert [s.response_ids for s in got] == [s.response_ids for s in samples]


def test_dump_layout_for_hdf5_tools(tmp_path: Path) -> None:
    samples = [s for s in _awkward() if max(s.prompt_ids, default=0) < 2**31]
    path = write_rollouts(tmp_path, 12, samples, {"trainer_version": 5})
    assert path == tmp_path / "rollouts" / "step_000012.h5"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    with h5py.File(path, "r") as f:
        assert set(f) == {"prompt_ids", "prompt_ids_offsets", "response_ids", "response_ids_offsets",
                          "rollout_logprobs", "rollout_logprobs_offsets", "loss_mask", "loss_mask_offsets", "reward",
                          "group", "index", "weight_version", "prompt_text", "response_text", "status", "label",
                          "reward_detail", "metadata", "routed_experts", "response_text_json"}
        assert dict(f.attrs) == {"step": 12, "trainer_version": 5}
        assert f["reward"][()].tolist() == [np.float32(s.scalar_reward) for s in samples]
        assert f["status"].asstr()[()].tolist() == [s.status.value for s in samples]
        assert f["response_text"].asstr()[()].tolist()[1] == "a\ufffdb?c"  # a readable copy for tools...
    assert read_rollouts(tmp_path, 12)[0][1].response_text == "a\x00b\ud800c"  # ...and the exact text for us


def test_unserialisable_metadata_is_a_clear_error(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "s.h5", "w") as f, pytest.raises(RuntimeFailure, match="'/carry'.*metadata"):
        write_samples(f.create_group("carry"), [Sample(prompt_ids=[1], metadata={"x": object()})])


def test_no_other_hdf5_writer_in_the_package() -> None:
    writers = sorted(str(p.relative_to(REPO)) for p in (REPO / "milehpc").rglob("*.py")
                     if re.search(r"create_dataset|require_dataset", p.read_text()))
    assert writers == ["milehpc/samples/h5.py"]
    dumps = (REPO / "milehpc" / "samples" / "dumps.py").read_text()
    assert "write_samples(f, samples, compact=True)" in dumps and "read_samples(f)" in dumps
