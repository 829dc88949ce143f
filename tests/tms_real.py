"""The real ``torch_memory_saver`` on a machine without libcuda: its whole Python layer runs; only what loads a CUDA
library is replaced, by a recording fake derived from the installed package at run time so it cannot drift.

Where 0.0.10 stops on a CPU machine (first ``region``/``pause``/``resume``, in ``_TorchMemorySaverImpl.__init__``):
``utils._detect_cuda_major`` probes ``libcudart.so.<N>``; ``torch.cuda.memory.CUDAPluggableAllocator`` and
``binary_wrapper.BinaryWrapper`` ``ctypes.CDLL`` the package's ``.so`` (needs ``libcuda.so.1``); the device module's
``MemPool``/``use_mem_pool`` need a CUDA build of torch. Those four are replaced here, nothing above them:

* the ``CDLL`` fake exposes exactly the functions the shipped ``.so`` exports (read from its ELF dynamic symbol
  table) and converts every argument with the ``argtypes`` the real ``_setup_function_signatures`` gave it
  (a ``str`` where the C side wants ``char*`` is refused as ctypes refuses it);
* behind it a small model of the native state (``csrc/entrypoint.cpp`` thread-local config, ``csrc/core.cpp``
  pause/resume) raises :class:`NativeAbort` where the library would ``exit(1)``;
* the memory itself (:class:`MemoryGuard`): every storage allocated inside a region (in the saver's pool, with the
  region config on) is recorded with its tag and backup setting, as ``tms_torch_malloc`` records it. ``pause(tag)``
  does what ``csrc/core.cpp`` ``TorchMemorySaver::pause`` does: copies the bytes out only when the region had
  ``enable_cpu_backup``, then releases the memory (the storage is resized to 0 bytes); any op on a paused tensor
  raises :class:`PausedTensorAccess` (on a GPU: an illegal memory access that poisons the CUDA context).
  ``resume(tag)`` maps fresh memory back: the backed-up bytes, else garbage (all bits set: NaN for floats), as
  ``TorchMemorySaver::resume`` maps new physical memory without initialising it;
* the allocator and device-module fakes bind their calls against the real torch signatures.

Used in-process by tests/test_tms_contract.py (:func:`installed`) and, for subprocesses, by the loader in
tests/standin_gpu_stack/torch_memory_saver/ (:func:`install_for_process`), which records to
``$MILEHPC_STANDIN_LOG/rank<R>.jsonl`` like the sglang stand-in.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import json
import os
import struct
import sys
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DIST = "torch_memory_saver"
CUDA_MAJOR = 12  # which of the shipped builds (``*_cu12``/``*_cu13``) the fake stands for


def tested_version() -> str:
    """The pinned version (milehpc.config.tested_versions; the gpu and dev extras pin the same)."""
    from milehpc.config.tested_versions import TESTED_GPU_PACKAGES

    return str(TESTED_GPU_PACKAGES[DIST])


def require_real() -> types.ModuleType:
    """The installed real package, or skip (plain run) / fail (``MILEHPC_REQUIRE_ALL=1``) naming the install."""
    try:
        import torch_memory_saver
    except ImportError:
        # imported here, not at the top: the subprocess loader has no tests/ on its path
        from required import unavailable

        unavailable(f"the real {DIST} is not installed (pip install --no-deps {DIST}=={tested_version()})")
    return torch_memory_saver


# ---- what the binary exports ---------------------------------------------------------------------------------
def exported_functions(path: str | os.PathLike[str]) -> set[str]:
    """Names of the functions an ELF64 little-endian shared object exports (its ``.dynsym``, defined, FUNC)."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not an ELF64 little-endian object"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out: set[str] = set()
    for _name, sh_type, _f, _a, offset, size, link, _i, _al, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        stroff = sections[link][4]
        for k in range(size // entsize):
            st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, offset + k * entsize)
            if st_shndx != 0 and st_info & 0xF == 2 and st_info >> 4 in (1, 2):  # defined, FUNC, GLOBAL|WEAK
                out.add(data[stroff + st_name:data.index(b"\0", stroff + st_name)].decode())
    return out


# ---- the native side -----------------------------------------------------------------------------------------
class NativeAbort(AssertionError):
    """Where the real library would end the process (``exit(1)`` / ``SIMPLE_CHECK``)."""


class PausedTensorAccess(RuntimeError):
    """An op read or wrote a tensor whose memory is paused (a GPU: illegal memory access, CUDA context lost)."""


GARBAGE = 0xFF  # what a resume without CPU backup leaves: never zeros a test could mistake for real weights


class _Allocation:
    """One storage allocated inside a region: its tag, whether the region backs it up, its bytes while paused."""

    def __init__(self, storage: Any, tag: str, cpu_backup: bool) -> None:
        self.storage = weakref.ref(storage)  # the tensor's death frees it (tms_torch_free), not the record
        self.tag, self.cpu_backup = tag, cpu_backup
        self.nbytes = storage.nbytes()
        self.backup: Any = None
        self.paused = False


class MemoryGuard:
    """The allocations of every region and the state of their memory, for the process (one per thread stack: the
    ``TorchDispatchMode`` below is pushed on the thread that first uses the saver).

    Records while a region is open (:meth:`recording`); refuses any op with a paused input. Its own copies run with
    ``busy`` set."""

    def __init__(self) -> None:
        self.by_storage: weakref.WeakKeyDictionary[Any, _Allocation] = weakref.WeakKeyDictionary()
        self.region: Native | None = None  # the library whose pool is in use (``use_mem_pool``)
        self.paused = 0  # how many allocations are paused (the fast path of every op)
        self.busy = False
        self.mode: Any = None

    def ensure_pushed(self) -> None:
        """Push the checking mode on this thread's dispatch stack at the saver's first use, not at import: SGLang's
        scheduler processes import the package with memory saving off and must run unobserved."""
        if self.mode is None:
            from torch.utils._python_dispatch import _push_mode

            self.mode = _guard_mode(self)
            _push_mode(self.mode)

    def pop(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode

        if self.mode is not None:
            assert _get_current_dispatch_mode() is self.mode, "another dispatch mode left on top of the guard"
            _pop_mode()
            self.mode = None

    def check(self, func: Any, tensors: list[Any]) -> None:
        for t in tensors:
            rec = self.by_storage.get(t.untyped_storage())
            if rec is not None and rec.paused:
                raise PausedTensorAccess(
                    f"{func}: a tensor allocated in torch_memory_saver region {rec.tag!r} is used while that tag is "
                    f"paused (on a GPU: an illegal memory access; resume({rec.tag!r}) first)")

    def record(self, new: list[Any]) -> None:
        native = self.region
        if native is None or not native.config["interesting_region"]:
            return
        tag = native.config["current_tag"].decode()
        for st in new:
            if st.nbytes() and st not in self.by_storage:
                self.by_storage[st] = _Allocation(st, tag, bool(native.config["enable_cpu_backup"]))

    def _bytes_of(self, storage: Any) -> Any:
        import torch

        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def pause(self, tag: str | None) -> None:
        """``TorchMemorySaver::pause``: back up (only with cpu backup), then release the memory."""
        self.busy = True
        try:
            for rec in list(self.by_storage.values()):
                st = rec.storage()
                if st is None or rec.paused or (tag is not None and rec.tag != tag):
                    continue
                rec.backup = self._bytes_of(st).clone() if rec.cpu_backup else None
                rec.nbytes = st.nbytes()
                with contextlib.suppress(RuntimeError):  # a non-resizable storage: the guard alone keeps it out
                    st.resize_(0)
                rec.paused = True
                self.paused += 1
        finally:
            self.busy = False

    def resume(self, tag: str | None) -> None:
        """``TorchMemorySaver::resume``: fresh memory, the backed-up bytes copied in, else left uninitialised."""
        self.busy = True
        try:
            for rec in list(self.by_storage.values()):
                st = rec.storage()
                if st is None or not rec.paused or (tag is not None and rec.tag != tag):
                    continue
                if st.nbytes() != rec.nbytes:
                    st.resize_(rec.nbytes)
                view = self._bytes_of(st)
                if rec.backup is not None:
                    view.copy_(rec.backup)
                else:
                    view.fill_(GARBAGE)
                rec.backup, rec.paused = None, False
                self.paused -= 1
        finally:
            self.busy = False


def _guard_mode(guard: MemoryGuard) -> Any:
    """The ``TorchDispatchMode`` behind :class:`MemoryGuard` (built lazily: torch is imported on first use)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if guard.busy or (not guard.paused and guard.region is None):
                return func(*args, **kwargs)
            inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if guard.paused:
                guard.check(func, inputs)
            out = func(*args, **kwargs)
            if guard.region is not None:  # new storages only: views and in-place results share an input's
                seen = {id(a.untyped_storage()) for a in inputs}
                guard.record([o.untyped_storage() for o in tree_flatten(out)[0]
                              if isinstance(o, torch.Tensor) and id(o.untyped_storage()) not in seen])
            return out

    return _Mode()


class Native:
    """The library's state behind the binding: config per ``csrc/entrypoint.cpp`` (defaults: tag ``default``,
    not in a region, pinned CPU backup), allocation state per tag per ``csrc/core.cpp``. ``calls``: every binding
    call with decoded arguments; ``events``: the region/pause/resume story (plus whatever a test appends)."""

    def __init__(self, path: str, log_dir: str | None = None) -> None:
        self.path, self.log_dir = path, log_dir
        self.config: dict[str, Any] = {"current_tag": b"default", "interesting_region": False,
                                       "enable_cpu_backup": False, "cpu_backup_backend": b"pinned",
                                       "enable_disk_backup": False, "retain_cpu_backup": False}
        self.tags: dict[str, str] = {}  # tag -> "active" | "paused" (tags that had a region)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.events: list[str] = []

    def event(self, call: str, tag: str | None) -> None:
        self.events.append(f"{call}:{tag}")
        if self.log_dir:  # the subprocess tests' per-rank record
            rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
            with open(Path(self.log_dir) / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"call": call, "tag": tag}) + "\n")

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        self.calls.append((name, args))
        if name.startswith("tms_set_") and name[8:] in self.config:
            return self._set(name[8:], args[0])
        if name.startswith("tms_get_") and name[8:] in self.config:
            return self.config[name[8:]]
        if name in ("tms_pause", "tms_resume"):
            return self._pause_resume(name[4:], args[0])
        return 0

    def _set(self, key: str, value: Any) -> None:
        if key == "current_tag" and value is None:
            raise NativeAbort("tms_set_current_tag(NULL): 'tag should not be null' (csrc/entrypoint.cpp)")
        if key == "interesting_region" and value and not self.config["interesting_region"]:
            tag = self.config["current_tag"].decode()
            if self.tags.get(tag) == "paused":  # new allocations would be active among paused ones
                raise NativeAbort(f"region {tag!r} entered while paused: its next resume would exit(1) "
                                  "(csrc/core.cpp TorchMemorySaver::resume)")
            self.tags[tag] = "active"
            self.event("region", tag)
        self.config[key] = value

    def _pause_resume(self, what: str, tag_bytes: bytes | None) -> int:
        tag = tag_bytes.decode() if tag_bytes else None
        want, then = ("active", "paused") if what == "pause" else ("paused", "active")
        for name in [t for t in self.tags if tag is None or t == tag]:
            if self.tags[name] != want:
                raise NativeAbort(f"{what}({tag!r}) with tag {name!r} {self.tags[name]}: the library exits(1) "
                                  f"(csrc/core.cpp TorchMemorySaver::{what})")
            self.tags[name] = then
        _STATE.guard.ensure_pushed()
        (_STATE.guard.pause if what == "pause" else _STATE.guard.resume)(tag)
        self.event(what, tag)
        return 0  # cudaSuccess


class _Function:
    """One exported C function: ctypes' defaults (no argtypes, restype c_int) until the real package sets them."""

    def __init__(self, native: Native, name: str) -> None:
        self.native, self.name = native, name
        self.argtypes: list[Any] | None = None
        self.restype: Any = ctypes.c_int

    def __call__(self, *args: Any) -> Any:
        types_ = self.argtypes or []  # untyped ones are the getters: no arguments (csrc/entrypoint.cpp)
        if len(args) != len(types_):
            raise TypeError(f"{self.name}: {len(args)} arguments, the binding declares {len(types_)}")
        for t, a in zip(types_, args, strict=True):
            t.from_param(a)  # ctypes' own conversion check: raises on a wrong type
        value = self.native.call(self.name, args)
        if self.restype is ctypes.c_char_p:
            assert value is None or isinstance(value, bytes)
        elif self.restype is ctypes.c_bool:
            value = bool(value)
        return value


class FakeCDLL:
    """``ctypes.CDLL(path)`` for one of the package's ``.so``: attributes are exactly its exported functions."""

    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        self._name = str(path)
        self._exports = exported_functions(path)
        self._native = _STATE.native_for(self._name)

    def __getattr__(self, name: str) -> _Function:
        if name.startswith("_") or name not in self._exports:
            raise AttributeError(f"{self._name}: undefined symbol: {name}")
        fn = self.__dict__[name] = _Function(self._native, name)  # argtypes set on it persist
        return fn


# ---- torch's CUDA side ---------------------------------------------------------------------------------------
def _bound(real: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, method: bool = False) -> None:
    """Refuse a call the real function's signature would refuse."""
    sig = inspect.signature(real)
    if method:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    sig.bind(*args, **kwargs)


class FakePluggableAllocator:
    """``torch.cuda.memory.CUDAPluggableAllocator``: checks the named functions are exported by the library."""

    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        exports = exported_functions(path_to_so_file)
        for fn in (alloc_fn_name, free_fn_name):
            assert fn in exports, f"{path_to_so_file} exports no {fn}"
        self.path = path_to_so_file

    def allocator(self) -> object:
        return ("allocator", self.path)


class FakeDeviceModule:
    """What ``torch.get_device_module()`` gives on a CUDA build, for the three names the package uses."""

    def __init__(self) -> None:
        import torch

        self._real = torch.cuda
        self.pools: list[dict[str, Any]] = []

    def MemPool(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # noqa: N802 - torch's name
        _bound(self._real.MemPool.__init__, args, kwargs, method=True)
        pool = {"args": args, "kwargs": kwargs}
        self.pools.append(pool)
        return pool

    @contextlib.contextmanager
    def use_mem_pool(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        _bound(self._real.use_mem_pool, args, kwargs)
        assert args[0] in self.pools, "use_mem_pool of a pool MemPool did not make"
        # Allocations now come from the library's allocator: the guard records them (with the region's config).
        guard = _STATE.guard
        guard.ensure_pushed()
        outer, guard.region = guard.region, _STATE.native_for(args[0]["kwargs"]["allocator"][1])
        try:
            yield
        finally:
            guard.region = outer

    def current_device(self, *args: Any, **kwargs: Any) -> int:
        _bound(self._real.current_device, args, kwargs)
        return 0


class _State:
    """Which Native each library path got (one process-wide library state, as with the real ``dlopen``)."""

    def __init__(self) -> None:
        self.log_dir: str | None = None
        self.natives: dict[str, Native] = {}
        self.guard = MemoryGuard()

    def native_for(self, path: str) -> Native:
        if path not in self.natives:
            self.natives[path] = Native(path, self.log_dir)
        return self.natives[path]


_STATE = _State()


def _patches(device: FakeDeviceModule) -> list[tuple[Any, str, Any]]:
    """(object, attribute, fake): everything below the libcuda line, nothing above it."""
    import torch
    import torch.cuda.memory
    from torch_memory_saver import binary_wrapper, utils

    shim = types.ModuleType("ctypes")  # binary_wrapper's ctypes, with the fake CDLL
    shim.__dict__.update(vars(ctypes))
    shim.CDLL = FakeCDLL  # type: ignore[attr-defined]
    real_get = torch.get_device_module

    def get_device_module(device_: Any = None) -> Any:
        # The fake for the package's own call only: SGLang's scheduler imports the package too, and its
        # ``torch.get_device_module().synchronize()`` must reach the real (CPU) module.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return device if device_ is None and caller.startswith(DIST) else real_get(device_)

    return [(utils, "_detect_cuda_major", lambda: CUDA_MAJOR), (binary_wrapper, "ctypes", shim),
            (torch.cuda.memory, "CUDAPluggableAllocator", FakePluggableAllocator),
            (torch, "get_device_module", get_device_module)]


def _check_signatures() -> None:
    """The fakes take what the real classes take (so a torch upgrade that changes them fails here)."""
    import torch.cuda.memory

    real = inspect.signature(torch.cuda.memory.CUDAPluggableAllocator.__init__)
    assert list(real.parameters) == list(inspect.signature(FakePluggableAllocator.__init__).parameters), real


class Installed:
    """The fresh saver the package's ``torch_memory_saver`` name points to, and what its binding recorded."""

    def __init__(self, saver: Any, device: FakeDeviceModule) -> None:
        self.saver, self.device = saver, device

    @property
    def native(self) -> Native:
        """The state of the library the saver loaded (after its first call)."""
        path = self.saver._impl._binary_wrapper.cdll._name
        return _STATE.natives[path]


@contextlib.contextmanager
def installed() -> Iterator[Installed]:
    """In this process, for the ``with`` body: a fresh ``torch_memory_saver.torch_memory_saver`` of the real
    package over the fakes; everything is put back after."""
    torch_memory_saver = require_real()
    _check_signatures()
    device = FakeDeviceModule()
    saver = torch_memory_saver.TorchMemorySaver()
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in _patches(device)]
    old_saver, old_natives, old_guard = torch_memory_saver.torch_memory_saver, dict(_STATE.natives), _STATE.guard
    _STATE.natives.clear()
    _STATE.guard = MemoryGuard()
    try:
        for obj, name, fake in _patches(device):
            setattr(obj, name, fake)
        torch_memory_saver.torch_memory_saver = saver
        yield Installed(saver, device)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        torch_memory_saver.torch_memory_saver = old_saver
        _STATE.natives.clear()
        _STATE.natives.update(old_natives)
        _STATE.guard.pop()
        _STATE.guard = old_guard


def install_for_process(log_dir: str | None) -> None:
    """For a subprocess (the loader in tests/standin_gpu_stack): the fakes for good, recording to ``log_dir``."""
    _check_signatures()
    _STATE.log_dir = log_dir
    device = FakeDeviceModule()
    for obj, name, fake in _patches(device):
        setattr(obj, name, fake)
    _end_at_teardown_like_the_pool(device)


def _end_at_teardown_like_the_pool(device: FakeDeviceModule) -> None:
    """In torch hook mode the region's ``MemPool`` hands its segments back through ``tms_torch_free`` when it is
    destroyed at the interpreter's teardown, outside any region, where ``SIMPLE_CHECK(is_interesting_region)`` ends
    the process with status 1 (csrc/entrypoint.cpp; seen on an H200 after a successful run). A subprocess whose saver
    made its pool and that reaches the normal teardown ends so here: threading's exit hooks run on a normal exit
    only, never after ``os._exit`` (:func:`milehpc.runtime.offload.end_process`)."""
    import threading

    def teardown() -> None:
        if device.pools:
            sys.stderr.write("[torch_memory_saver.cpp] only support interesting region file=csrc/entrypoint.cpp "
                             "func=tms_torch_free (stand-in: the region's MemPool freed at interpreter teardown)\n")
            sys.stderr.flush()
            os._exit(1)

    threading._register_atexit(teardown)  # type: ignore[attr-defined]
