"""Contract: milehpc's offload driver (milehpc/runtime/offload.py) against the installed real torch_memory_saver.

The package's Python layer runs for real (hook mode, regions, tags, pools, pause/resume); only what loads a CUDA
library is replaced, by fakes derived from the installed package at test time (tests/tms_real.py). Without the
package these tests skip naming the install, and fail under ``MILEHPC_REQUIRE_ALL=1`` (CI).
"""

from __future__ import annotations

import ctypes
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import tms_real
import torch

from milehpc.errors import RuntimeFailure
from milehpc.runtime.offload import ColocatedStep, torch_memory_saver_backend


def test_contract_tms_is_the_pinned_version_and_stops_at_the_cuda_libraries() -> None:
    tms = tms_real.require_real()
    assert version("torch_memory_saver") == tms_real.tested_version()
    assert "standin" not in tms.__file__
    if not torch.cuda.is_available():  # where the real package stops here: building its implementation
        saver = tms.TorchMemorySaver()
        saver.hook_mode = "torch"
        with pytest.raises((OSError, RuntimeError)):  # no libcudart to detect / the .so needs libcuda.so.1
            saver.pause("train")
        assert saver._impl is None
    # The mode is fixed by the first call, and the default (preload) needs LD_PRELOAD: set it first or fail.
    with tms_real.installed() as inst, pytest.raises(AssertionError, match="LD_PRELOAD"):
        inst.saver.pause("train")


def test_contract_tms_binding_fake_is_the_shipped_binary() -> None:
    tms = tms_real.require_real()
    with tms_real.installed() as inst:
        saver = torch_memory_saver_backend()
        assert saver is inst.saver
        saver.pause("nothing-allocated")  # the first call builds the implementation
        cdll = saver._impl._binary_wrapper.cdll
        so = Path(cdll._name)
        assert so.parent == Path(tms.__file__).parent or so.parent == Path(tms.__file__).parent.parent
        assert so.name.startswith(f"torch_memory_saver_hook_mode_torch_cu{tms_real.CUDA_MAJOR}")  # torch mode
        exports = tms_real.exported_functions(so)
        assert {"tms_pause", "tms_resume", "tms_set_current_tag", "tms_torch_malloc", "tms_torch_free"} <= exports
        assert cdll.tms_set_current_tag.argtypes == [ctypes.c_char_p]  # typed by the real package
        with pytest.raises(TypeError):
            cdll.tms_set_current_tag("train")  # str where char* is wanted: ctypes refuses it, so does the fake
        assert not hasattr(cdll, "tms_xpu_prewarm_devices")  # not in this build: the XPU branch stays off
        assert inst.native.calls == [("tms_pause", (b"nothing-allocated",))]


class _Engine:
    """The rollout side of the step, recording into the binding's story (SGLang's own calls: tests/test_sglang_*)."""

    def __init__(self, story: list[str]) -> None:
        self.story = story

    def health(self) -> bool:
        return True

    def generate(self, prompts: list[list[int]], sampling: Any) -> list[str]:
        self.story.append("engine.generate")
        return ["sample"]

    def release_memory(self) -> None:
        self.story.append("engine.release_memory")

    def resume_memory(self, tags: list[str]) -> None:
        self.story.append(f"engine.resume_memory:{','.join(tags)}")

    def update_weights(self, named: Any, version: int) -> None:
        assert [n for n, _ in named] == ["w"]
        self.story.append(f"engine.update_weights:{version}")


class _Trainer:
    def __init__(self, story: list[str]) -> None:
        self.story, self.version = story, 0
        self.w = torch.ones(2)

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [("w", self.w)]

    def train_step(self, samples: list[str], step: int) -> dict[str, float]:
        self.story.append("trainer.train_step")
        self.version += 1
        return {"loss": 0.0}


def test_contract_tms_colocated_step_order_at_the_binding() -> None:
    with tms_real.installed() as inst:
        story: list[str] = []
        colo = ColocatedStep(_Engine(story), None, torch_memory_saver_backend(), memory_probe=lambda: 0)
        with colo.train_region():  # the trainer is built in the pausable region
            colo.trainer = _Trainer(story)
        native = inst.native
        native.events = story  # one story: the binding's region/pause/resume among the engine's calls
        colo.initial_sync(0)
        colo.step([[1]], None, 0)
        assert story == ["pause:train", "engine.update_weights:0",  # initial sync: trainer off before the update
                         "engine.generate", "engine.release_memory",  # generate, offload rollout
                         "resume:train", "region:train", "trainer.train_step",  # onload train, train in the region
                         "pause:train",  # offload train, then the rollout side comes back in two parts
                         "engine.resume_memory:weights", "engine.update_weights:1",
                         "engine.resume_memory:kv_cache,cuda_graph"]
        # A region is the real package's config calls, restored after (CPU backup on, pinned host copy).
        region = [c for c in native.calls if c[0].startswith("tms_set_")][:4]
        assert region == [("tms_set_current_tag", (b"train",)), ("tms_set_interesting_region", (True,)),
                          ("tms_set_enable_cpu_backup", (True,)), ("tms_set_enable_disk_backup", (False,))]
        assert native.config["current_tag"] == b"default" and not native.config["interesting_region"]
        assert len(inst.device.pools) == 1  # one MemPool for the tag, reused by every train region
        assert inst.device.pools[0]["kwargs"]["allocator"][0] == "allocator"

        # What the library would end the process on never reaches it from milehpc...
        calls = len(native.calls)
        colo.offload_train()  # already paused: no second pause
        with pytest.raises(RuntimeFailure, match="paused"), colo.train_region():
            pass
        assert len(native.calls) == calls
        # ...while the fake does refuse it (csrc/core.cpp: exit(1)), as the library would.
        with pytest.raises(tms_real.NativeAbort, match="exit"):
            inst.saver.pause("train")
        # The saver is built in torch mode now: asking for another mode is one clear error, not a silent keep.
        with pytest.raises(RuntimeFailure, match="hook_mode='torch'"):
            torch_memory_saver_backend("preload")
        assert torch_memory_saver_backend("torch") is inst.saver


def test_contract_tms_checkpoint_runs_while_the_trainer_is_resident() -> None:
    """The loop's checkpoint hook (``train_phase(resident=...)``) runs after training and before the pause, as
    Miles/slime save: the trainer's tensors are read while its tag is active at the binding."""
    with tms_real.installed() as inst:
        story: list[str] = []
        colo = ColocatedStep(_Engine(story), None, torch_memory_saver_backend(), memory_probe=lambda: 0)
        with colo.train_region():
            colo.trainer = _Trainer(story)
        colo.initial_sync(0)
        colo.offload_rollout()  # as generate_phase does: only released tags are resumed
        story.clear()
        native = inst.native
        native.events = story
        seen: list[str] = []

        def checkpoint(metrics: dict[str, float]) -> None:
            assert metrics == {"loss": 0.0}  # train()'s own metrics
            seen.append(native.tags["train"])
            story.append("checkpoint")

        colo.train_phase(lambda: colo.trainer.train_step([], 0), resident=checkpoint)
        assert seen == ["active"]
        assert story == ["resume:train", "region:train", "trainer.train_step", "checkpoint", "pause:train",
                         "engine.resume_memory:weights", "engine.update_weights:1",
                         "engine.resume_memory:kv_cache,cuda_graph"]


# ---- the memory: a paused region's tensors are unusable until resumed (csrc/core.cpp pause/resume) -------------
def _saver_in_torch_mode(inst: tms_real.Installed) -> Any:
    inst.saver.hook_mode = "torch"  # milehpc's mode (runtime/offload.py); preload would need LD_PRELOAD
    return inst.saver


def test_standin_tms_paused_tensors_fail_on_use_and_come_back_with_cpu_backup() -> None:
    with tms_real.installed() as inst:
        saver = _saver_in_torch_mode(inst)
        outside = torch.ones(3)  # the default allocator: never paused
        with saver.region("train", enable_cpu_backup=True):
            layer = torch.nn.Linear(4, 4)
            moments = torch.randn(4, 4)
        weight, row = layer.weight.detach().clone(), layer.weight[0]  # a copy (outside any region) and a view
        saver.pause("train")
        assert layer.weight.untyped_storage().nbytes() == 0  # the memory is released, not just flagged
        for use in (lambda: layer(torch.ones(1, 4)), lambda: moments.sum(), lambda: row + 1,
                    lambda: moments.copy_(torch.zeros(4, 4)), lambda: layer.weight.detach().clone()):
            with pytest.raises(tms_real.PausedTensorAccess, match="region 'train' .* paused"):
                use()
        assert float(outside.sum()) == 3.0 and torch.equal(weight + 0, weight)  # the rest of the process is fine
        saver.resume("train")
        assert torch.equal(layer.weight, weight) and torch.equal(row, weight[0])  # the CPU backup came back
        layer(torch.ones(1, 4)).sum().backward()  # and the tensors are usable again, autograd included


def test_standin_tms_resume_without_cpu_backup_gives_garbage_and_tags_pause_apart() -> None:
    with tms_real.installed() as inst:
        saver = _saver_in_torch_mode(inst)
        with saver.region("kv"):  # no CPU backup: what comes back is new memory (csrc/core.cpp resume)
            kv = torch.zeros(8)
            ids = torch.arange(4)
        with saver.region("train", enable_cpu_backup=True):
            w = torch.ones(2)
        saver.pause("kv")
        assert float(w.sum()) == 2.0  # another tag stays usable
        with pytest.raises(tms_real.PausedTensorAccess, match="'kv'"):
            kv.add_(1)
        saver.resume("kv")
        assert bool(kv.isnan().all()) and ids.tolist() == [-1] * 4  # uninitialised: never the old zeros
        saver.pause(None)  # every tag
        with pytest.raises(tms_real.PausedTensorAccess):
            w.sum()
        saver.resume(None)
        assert w.tolist() == [1.0, 1.0]


def test_standin_tms_colocated_trainer_is_unusable_between_offload_and_onload() -> None:
    """milehpc's driver: the trainer built in ``train_region`` is paused by ``offload_train`` (its weights cannot be
    read, as on a GPU) and whole again after ``onload_train`` (the region backs up)."""
    with tms_real.installed():
        story: list[str] = []
        colo = ColocatedStep(_Engine(story), None, torch_memory_saver_backend(), memory_probe=lambda: 0)
        with colo.train_region():
            colo.trainer = _Trainer(story)
            colo.trainer.w.mul_(3)
        colo.initial_sync(0)
        with pytest.raises(tms_real.PausedTensorAccess):
            colo.trainer.export_weights()[0][1].sum()
        colo.onload_train()
        assert colo.trainer.w.tolist() == [3.0, 3.0]
