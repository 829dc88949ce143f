"""Not a stand-in: the REAL installed ``torch_memory_saver`` (found on ``sys.path`` past this folder), loaded in this
module's place, with only its CUDA-library binding replaced by tests/tms_real.py's derived recording fake (calls
recorded to ``$MILEHPC_STANDIN_LOG/rank<R>.jsonl``). This folder is on PYTHONPATH of some tests' subprocesses only;
those tests skip without the real package (tests/tms_real.py ``require_real``)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
_others = [p for p in sys.path if Path(p or ".").resolve() != _here.parent]
_spec = importlib.machinery.PathFinder.find_spec(__name__, _others)
if _spec is None or _spec.origin is None:
    raise ImportError("the real torch_memory_saver is not installed (pip install --no-deps torch_memory_saver==0.0.10)")
# Become the real package: its submodules load from its own folder, its binaries sit next to it.
__path__ = list(_spec.submodule_search_locations or [])
__file__ = _spec.origin
exec(compile(Path(_spec.origin).read_text(), _spec.origin, "exec"), globals())

_helper = importlib.util.spec_from_file_location("_milehpc_tests_tms_real", _here.parents[1] / "tms_real.py")
assert _helper is not None and _helper.loader is not None
_tms_real = importlib.util.module_from_spec(_helper)
_helper.loader.exec_module(_tms_real)
_tms_real.install_for_process(os.environ.get("MILEHPC_STANDIN_LOG"))
