"""CPU stand-in for ``torch_memory_saver`` (test of scripts/gpu_check.py only): region/pause/resume by tag."""

from __future__ import annotations

import contextlib


class _Saver:
    def __init__(self) -> None:
        self.hook_mode = "preload"
        self.paused: set[str] = set()

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False):
        assert tag not in self.paused
        yield

    def pause(self, tag: str | None = None) -> None:
        self.paused.add(tag)

    def resume(self, tag: str | None = None) -> None:
        self.paused.discard(tag)


torch_memory_saver = _Saver()
