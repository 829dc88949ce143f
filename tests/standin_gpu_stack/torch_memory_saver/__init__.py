"""CPU stand-in for ``torch_memory_saver``: region/pause/resume by tag, recorded like the sglang stand-in
(``$MILEHPC_STANDIN_LOG/rank<R>.jsonl``). Used by tests/test_sglang_gpu_check_script.py and
tests/test_sglang_loop_standin.py."""

from __future__ import annotations

import contextlib

from sglang import record


class _Saver:
    def __init__(self) -> None:
        self.hook_mode = "preload"
        self.paused: set[str] = set()

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False):
        assert tag not in self.paused
        record("region", tag=tag)
        yield

    def pause(self, tag: str | None = None) -> None:
        record("pause", tag=tag)
        self.paused.add(tag)

    def resume(self, tag: str | None = None) -> None:
        record("resume", tag=tag)
        self.paused.discard(tag)


torch_memory_saver = _Saver()
