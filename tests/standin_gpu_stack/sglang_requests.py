"""What milehpc's SGLangEngine sends through ``engine.tokenizer_manager``: SGLang's ``io_struct`` request objects
(the real ones, built by milehpc) to async methods, here answered by a stand-in engine's plain methods. An update
outside a begin/end session is refused, as SGLang's weight updater does. Used by the recording engine of
tests/test_sglang_colocate.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

REFUSED = "{what} must run between begin_weight_update() and end_weight_update()"


class WeightUpdateRequests:
    def __init__(self, engine: Any, record: Callable[..., None] | None = None) -> None:
        self.engine, self.record, self.session = engine, record or (lambda call, **info: None), False

    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self.record("begin_weight_update", selector=obj.selector)
        self.session = True
        return True, "Success"

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self.record("end_weight_update")
        self.session = False
        return True, "Success"

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        from sglang.srt.utils import MultiprocessingSerializer

        if not self.session:
            return False, REFUSED.format(what="update_weights_from_tensor")
        named = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])  # TP rank 0's payload
        return self.engine.update_weights_from_tensor(named, load_format=obj.load_format, flush_cache=obj.flush_cache)

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        if not self.session:
            return False, REFUSED.format(what="update_weights_from_distributed")
        return self.engine.update_weights_from_distributed(obj.names, obj.dtypes, obj.shapes, obj.group_name,
                                                           flush_cache=obj.flush_cache, load_format=obj.load_format)


def attach(engine: Any, record: Callable[..., None] | None = None) -> None:
    """Give a stand-in engine the event loop and tokenizer manager that milehpc's requests go through."""
    engine.loop = asyncio.new_event_loop()
    engine.tokenizer_manager = WeightUpdateRequests(engine, record)
