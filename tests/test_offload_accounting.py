"""What the colocated driver (:class:`milehpc.runtime.offload.ColocatedStep`) reports when its engine dies: each phase
timed once (a refill after a death at the KV-cache onload is an update, not also part of the onload), and a death
at the rollout offload logged in one line (rank, engine, what died) and counted — once, not again at its restart.

The real SGLangEngine with the recording stand-ins of tests/test_sglang_colocate.py for what needs a GPU
(torch_memory_saver, the in-process ``sglang.Engine``); a death is what SGLang's dying child does: SIGQUIT to the
rank (:func:`milehpc.rollout.sglang_engine.sigquit_handler`)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from test_sglang_colocate import _build, _score

from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.sglang_engine import sigquit_handler

UPDATE_S = 10.0  # what one weight update takes on the step's clock


def _colocated(log: list[str]) -> tuple[Any, Any, dict[str, float]]:
    """The driver after its initial sync, on a clock that advances only while the engine takes weights."""
    _, engine, colo = _build(log)
    clock = {"now": 0.0}
    update = engine.update_weights

    def timed_update(named: Any, version: int) -> None:
        update(named, version)
        clock["now"] += UPDATE_S

    engine.update_weights = timed_update
    colo.clock = lambda: clock["now"]
    colo.rank = 5
    colo.initial_sync(version=0)
    return engine, colo, clock


def _generate(colo: Any, engine: Any, *, die: bool = False) -> list[Any]:
    def produce() -> list[Any]:
        samples = engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=4, n=2))
        if die:
            sigquit_handler()  # the scheduler dies right after the batch
        return samples

    samples = colo.generate_phase(produce)
    _score(samples)
    return samples


def test_a_refill_after_a_death_at_the_kv_onload_is_timed_once(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    engine, colo, clock = _colocated(log)
    samples = _generate(colo, engine)
    update = engine.update_weights

    def update_then_die(named: Any, version: int) -> None:  # dies after its update, before the KV cache returns
        update(named, version)
        engine.update_weights = update
        sigquit_handler()

    engine.update_weights = update_then_die
    start = clock["now"]
    with caplog.at_level(logging.WARNING, logger="milehpc.runtime.offload"):
        metrics = colo.train_phase(lambda: colo.trainer.train_step(samples, 0))
    times = colo.report.times
    assert engine.restarts == 1 and engine.weight_version() == 1  # restarted and refilled
    assert colo.report.events[-3:] == ["update_weights", "onload_kv", "update_weights"]
    # Two updates on the clock: both in update_weights, none in onload_kv; the phases add up to the step's time.
    assert times["update_weights"] == 2 * UPDATE_S and times["onload_kv"] == 0.0, times
    assert sum(times.values()) == clock["now"] - start, times
    assert metrics["time/sync"] == 2 * UPDATE_S and metrics["colocate/engine_deaths"] == 1.0
    (line,) = caplog.messages
    assert line.startswith("milehpc: rank 5: rollout engine 0 died before resuming kv_cache,cuda_graph ("), line


def test_a_death_at_the_rollout_offload_is_logged_and_counted_once(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    engine, colo, _ = _colocated(log)
    with caplog.at_level(logging.WARNING, logger="milehpc.runtime.offload"):
        samples = _generate(colo, engine, die=True)
        (line,) = caplog.messages  # at the offload itself, where the death is swallowed
        assert line == ("milehpc: rank 5: rollout engine 0 died after generating, before releasing its memory (an "
                        "SGLang subprocess signalled a failure (SIGQUIT)); restarting it in place"), line
        assert not any(e.startswith("sglang.release_memory_occupation") for e in log)
        metrics = colo.train_phase(lambda: colo.trainer.train_step(samples, 0))
    assert len(caplog.messages) == 1  # the restart at the weights onload is the same death
    assert engine.restarts == 1 and engine.weight_version() == 1 and engine.health()
    assert metrics["colocate/engine_deaths"] == 1.0
