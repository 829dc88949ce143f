"""Built-in metrics loggers (registered like any third-party plugin); implementations in
:mod:`milehpc.runtime.loggers`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from milehpc.config.schema import opt
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Logger

_RT = "milehpc.runtime.loggers:"


@dataclass
class WandbParams:
    """``[logging.params.wandb]``."""

    project: str = opt("milehpc", pattern=r"[^/\s]{1,128}", expect="a W&B project name")
    entity: str | None = opt(None, pattern=r"[^/\s]{1,128}", expect="a W&B team or user name")
    mode: Literal["auto", "offline", "online", "disabled"] = opt(
        "auto", help="auto = online only where the site partition says network = true, else offline")
    group: str | None = opt(None, help="W&B run group (e.g. one sweep)")
    tags: list[str] = opt([])


@hookimpl
def milehpc_loggers() -> Iterator[Logger]:
    yield Logger(name="jsonl", impl=_RT + "JsonlLogger",
                 description="RUN_DIR/metrics.jsonl, one record per step (read by milehpc plot)")
    yield Logger(name="tensorboard", impl=_RT + "TensorBoardLogger", requires=("tensorboard",),
                 description="TensorBoard scalars in RUN_DIR/tensorboard")
    yield Logger(name="wandb", impl=_RT + "WandbLogger", requires=("wandb",), schema=WandbParams,
                 description="Weights & Biases; offline on nodes without network (wandb sync afterwards)")
