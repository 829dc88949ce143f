"""The engine and trainer members the loop, the weight sync and the colocated driver call are declared once, as
protocols (:class:`milehpc.rollout.engine.Engine`, :class:`~milehpc.rollout.engine.DirectSyncEngine`,
:class:`milehpc.train.base.Trainer`); every engine and trainer class implements every declared member. A member is
found in the class (or a base): a method, property or class attribute, a dataclass field, or ``self.NAME = ...``
in any of its methods (instance attributes)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Protocol

import pytest

from milehpc.rollout.engine import DirectSyncEngine, Engine
from milehpc.rollout.reference import ReferenceEngine
from milehpc.rollout.sglang_engine import SGLangEngine
from milehpc.rollout.supervisor import EngineSupervisor
from milehpc.train.base import Trainer
from milehpc.train.megatron.trainer import MegatronTrainer
from milehpc.train.torch_trainer import TorchTrainer


def declared(protocol: type) -> set[str]:
    """The members a protocol (and the protocols it extends) declares: methods, properties, annotated attributes."""
    out: set[str] = set()
    for klass in protocol.__mro__:
        if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        out |= {n for n in vars(klass) if not n.startswith("_")}
        out |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
    return out


def implemented(cls: type) -> set[str]:
    """What ``cls`` provides: its attributes and the ``self.NAME =`` assignments in the source of it and its bases."""
    out = {n for n in dir(cls) if not n.startswith("__")}
    for klass in cls.__mro__:
        if klass is object:
            continue
        out |= set(getattr(klass, "__annotations__", {}))
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        out.add(e.attr)
    return out


def missing(cls: type, protocol: type) -> set[str]:
    return declared(protocol) - implemented(cls)


@pytest.mark.parametrize(("cls", "protocol"), [
    (ReferenceEngine, Engine), (EngineSupervisor, Engine), (SGLangEngine, DirectSyncEngine),
    (TorchTrainer, Trainer), (MegatronTrainer, Trainer),
], ids=lambda x: x.__name__)
def test_every_engine_and_trainer_implements_its_protocol(cls, protocol) -> None:
    assert not missing(cls, protocol), f"{cls.__name__} lacks {sorted(missing(cls, protocol))} of {protocol.__name__}"


def test_the_loop_sees_what_the_protocols_declare() -> None:
    assert {"tokens_generated", "generate", "update_weights", "state_dict", "health", "restart"} <= declared(Engine)
    assert {"is_leader", "needs_weight_sync", "join_update_group", "generate"} <= declared(DirectSyncEngine)
    assert {"version", "export_is_collective", "sft_optimizer", "skip_step", "train_step"} <= declared(Trainer)


def test_a_class_missing_a_member_is_found() -> None:
    class Half:
        def __init__(self) -> None:
            self.version = 0

        def train_step(self, samples, step):
            return {}

    gaps = missing(Half, Trainer)
    assert "version" not in gaps and "train_step" not in gaps
    assert {"export_is_collective", "skip_step", "sft_optimizer", "export_weights"} <= gaps
