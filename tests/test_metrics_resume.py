"""Metrics continue after a resume, without duplicates or gaps: ``metrics.jsonl`` (what `milehpc plot` reads), the
real TensorBoard event files (read back by TensorBoard's own EventAccumulator, which applies ``purge_step``) and the
rollout dumps. The lost run got further than its checkpoint (a KILL after step 5, the checkpoint after step 3)."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from milehpc.runtime.metrics import MetricsLogger, read_metrics
from milehpc.samples import Sample
from milehpc.samples.dumps import drop_from, list_steps, write_rollouts


def _log(run_dir: Path, steps: range, value: float, *, resume_at: int | None = None) -> None:
    logger = MetricsLogger(run_dir, 8, progress=False)
    if resume_at is not None:
        logger.continue_from(resume_at)
    for s in steps:
        logger.log(s, {"rollout/reward_mean": value + s, "train/loss": -value - s})
    logger.close()


def test_a_resumed_run_rewrites_its_steps_in_jsonl_and_tensorboard(tmp_path: Path, monkeypatch) -> None:
    # TensorBoard names an event file by its second, then a per-process counter that sorts as text: the lost run's
    # file ".9" and the resumed run's ".10", written in one second, sorted the resumed one first (seen in CI when
    # earlier tests of the worker had made nine writers).
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    _log(tmp_path, range(0, 6), 0.0)  # the lost run: steps 0-5
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rollout/rew')  # torn by the kill
    _log(tmp_path, range(3, 8), 100.0, resume_at=3)  # resumed from the checkpoint after step 3

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(8))
    assert [r["rollout/reward_mean"] for r in lines] == [0, 1, 2, 103, 104, 105, 106, 107]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(8))

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in events] == list(range(8))
    assert [e.value for e in events] == [0, 1, 2, 103, 104, 105, 106, 107]
    # every metric of a step is a scalar of its own (the logger writes them as one event per step)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(s, -v) for s, v in
                                                                      zip(range(8), [0, 1, 2, 103, 104, 105, 106, 107], strict=True)]


def test_read_metrics_skips_a_torn_last_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"step": 1, "x"')
    assert read_metrics(tmp_path) == [{"step": 0, "x": 1}]


def test_dumps_from_the_resumed_step_on_are_dropped(tmp_path: Path) -> None:
    sample = Sample(prompt_ids=[1, 2], response_ids=[3], group=0, index=0)
    for s in range(6):
        write_rollouts(tmp_path, s, [sample])
    assert drop_from(tmp_path, 3) == [3, 4, 5]
    assert list_steps(tmp_path) == [0, 1, 2]


def test_a_complete_last_record_without_its_newline_keeps_its_own_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"step": 1, "x": 2}')  # killed before the newline
    logger = MetricsLogger(tmp_path, 4, progress=False)
    logger.continue_from(2)
    logger.log(2, {"x": 3.0})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
