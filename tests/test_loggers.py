"""Loggers as plugins: [logging] selects registered loggers and checks their params on the login node; W&B goes
online only where the site says compute nodes have network, else it writes an offline run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milehpc.config.job import wandb_mode
from milehpc.config.load import job_from_dict
from milehpc.errors import ConfigError, MilehpcError
from milehpc.runtime.metrics import MetricsLogger


def test_logging_table_names_registered_loggers_with_checked_params() -> None:
    job = job_from_dict({"name": "l", "logging": {"loggers": ["jsonl", "wandb"], "params": {"wandb": {"project": "p"}}}})
    assert job.logging.loggers == ["jsonl", "wandb"]
    assert job_from_dict({"name": "l"}).logging.loggers == ["jsonl", "tensorboard"]
    with pytest.raises(MilehpcError, match=r"j.toml: logging.loggers: unknown logger 'tb' \(expected one of: .*"
                                           r"tensorboard"):
        job_from_dict({"name": "l", "logging": {"loggers": ["tb"]}}, file="j.toml")
    with pytest.raises(ConfigError, match=r"logging.params.wandb.mode: expected one of 'auto', 'offline'"):
        job_from_dict({"name": "l", "logging": {"loggers": ["wandb"], "params": {"wandb": {"mode": "cloud"}}}})
    with pytest.raises(ConfigError, match=r"logging.params.wandb: expected parameters of a logger in "
                                          r"logging.loggers \(jsonl, tensorboard\), got 'wandb'"):
        job_from_dict({"name": "l", "logging": {"params": {"wandb": {"project": "p"}}}})


def test_wandb_is_offline_unless_the_site_says_nodes_have_network() -> None:
    assert wandb_mode("auto", network=False) == "offline"
    assert wandb_mode("auto", network=True) == "online"
    assert wandb_mode("offline", network=True) == "offline"
    with pytest.raises(ConfigError, match="logging.params.wandb.mode: expected mode = 'offline' or 'auto'"):
        wandb_mode("online", network=False)


def test_for_job_reads_the_sites_network_flag(tmp_path: Path, monkeypatch) -> None:
    """The rank's W&B logger is built with the run's site partition's network flag (RUN_DIR/site.json)."""
    import milehpc.runtime.loggers as loggers

    seen = []
    monkeypatch.setattr(loggers, "WandbLogger", lambda ctx, **params: seen.append((ctx.network, params)) or
                        loggers.JsonlLogger(ctx))
    job = job_from_dict({"name": "l", "logging": {"loggers": ["wandb"], "params": {"wandb": {"mode": "online"}}}})
    MetricsLogger.for_job(job, tmp_path, progress=False).close()
    (tmp_path / "site.json").write_text(json.dumps({"partition": {"network": True}}))
    MetricsLogger.for_job(job, tmp_path, progress=False).close()
    assert [n for n, _ in seen] == [False, True] and seen[0][1]["mode"] == "online"
