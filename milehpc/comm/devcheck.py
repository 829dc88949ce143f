"""Device-placement checking: make a CPU run fail where a GPU run would.

The fault class: a tensor on the wrong device reaching an NCCL/RCCL collective (NCCL reduces GPU tensors only) or a
module whose weights live elsewhere. On a CPU machine every tensor is on the CPU and gloo accepts anything, so such
code passes CI and fails on the first GPU step. This mode tracks the device each tensor is *meant* to be on:

* a tensor made with ``device='cuda'`` / ``device=torch.cuda.current_device()``, or moved with ``.cuda()`` /
  ``.to('cuda')`` (which return a fresh alias: the source stays a CPU tensor, as on a GPU), is recorded as CUDA (a
  tensor attribute); so is anything computed from a CUDA tensor (except in-place ops, which keep their target's
  device); ``.cpu()`` / ``.to('cpu')`` of a CUDA tensor is a fresh CPU copy; moving a ``Parameter`` records the
  parameter itself (``module.cuda()`` / ``module.to()`` then set ``param.data``, which no mode sees);
* the default process group and every group made by ``torch.distributed.new_group`` without ``backend="gloo"``
  stand for NCCL: no tensor a collective on them gets may be recorded as CPU (factories without a CUDA device and
  results of CPU-only inputs are; tensors the mode never saw made, such as gradients from the autograd engine, are
  "unknown" and pass); gloo groups take anything;
* every module's forward gets its inputs on its parameters' recorded device;
* NCCL's own rules on *every* operation of a process group that stands for NCCL, the ProcessGroup's (and a bare
  backend's) own methods included (``pg.broadcast``, ``pg.allreduce``... of the default group, of ``new_group``'s and
  of groups built with ``_new_process_group_helper`` as SGLang's update groups are): the list of methods is read from
  the installed torch's bindings (:func:`work_methods`). CUDA tensors only; one device per rank (one call's tensors on
  one device, and the same device for every call of a rank on a group); no two members of a group on one GPU of one
  host (each member's GPU, declared into the group's store with :func:`declare_device`, is checked at the group's
  first operation, when NCCL builds its communicator and fails with "Duplicate GPU detected"); and a
  ``work.wait(timeout)`` is measured from when the operation was enqueued and, once past, aborts the group as
  ``WorkNCCL::wait`` does (the wait raises ``DistBackendError``, the work reads as completed, every later operation
  on the group fails). Object collectives (``all_gather_object``...) put their tensors where torch puts them for an
  NCCL group: on CUDA. Seen on an H200 (torch 2.11+cu130, NCCL 2.28.9): a CPU tensor to an NCCL group's
  ``pg.broadcast`` raised; a ``wait(1 s)`` begun 0.8 s after the enqueue threw "... ran for 1000 milliseconds before
  timing out" (no "timed out"), the work then read as completed and the next operation raised "NCCL communicator was
  aborted"; two ranks on one GPU failed with "Duplicate GPU detected".

A violation raises :class:`DevicePlacementError` naming the call, the tensor and the line that made the call.
On a real GPU the same checks read the tensors' real devices. Turned on by ``MILEHPC_DEVICE_CHECK=nccl`` (the
Megatron CPU adaptation reads it; tests set it for trainer processes) or :func:`enable`.

:class:`CudaOnCpu` is also the redirect the Megatron CPU adaptation uses without checking (device='cuda' -> CPU,
``.cuda()`` a no-op, CUDA type names for ``Tensor.type()``), so checked and unchecked runs take the same path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import socket
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ENV = "MILEHPC_DEVICE_CHECK"
_ATTR = "_milehpc_intended_device"
_INDEX_ATTR = "_milehpc_intended_index"  # the CUDA ordinal a tensor was moved to or made on, when one was named
DEVICE_KEY = "milehpc-devcheck/device/"  # + group rank, in a group's store: "host/gpu index" of that member
# torch.distributed functions whose tensors are checked (isend/irecv are checked through batch_isend_irecv: P2POp
# compares its op against the unwrapped functions).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
               "all_to_all_single", "gather", "scatter", "send", "recv", "batch_isend_irecv")
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


class DevicePlacementError(RuntimeError):
    """A tensor on a device the collective's backend or the module cannot use."""


class _State:
    def __init__(self, backend: str, simulate: bool) -> None:
        self.backend = backend
        self.simulate = simulate  # the CPU stands in for CUDA: read recorded devices, not real ones
        self.group_device: dict[Any, str] = {}  # groups asked for as gloo -> "cpu"; others need the accelerator
        self.originals: dict[str, Callable[..., Any]] = {}
        self.violations = 0
        # NCCL's rules on process groups (see the module doc): works in flight, aborted groups, each group's device
        # on this rank, the groups whose members' devices were checked.
        self.works: weakref.WeakKeyDictionary[Any, _Pending] = weakref.WeakKeyDictionary()
        self.aborted: dict[Any, str] = {}
        self.rank_device: dict[Any, str] = {}
        self.devices_checked: set[Any] = set()
        self.suspended: set[Any] = set()  # groups whose communicator memory is released (ncclCommSuspend)


_STANDIN_INDEX = 0  # torch.device("cpu", 0): what torch.cuda.current_device() answers under the check
_STATE: _State | None = None
_MODE: Any = None  # the pushed CudaOnCpu mode (one per process)


def requested() -> str | None:
    """The backend the environment asks the check to stand for (``MILEHPC_DEVICE_CHECK=nccl``), or None."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "off", "false"):
        return None
    if value not in ("nccl", "1", "on", "true"):
        raise ValueError(f"{ENV}={value!r}: expected nccl (or off)")
    return "nccl"


def enabled() -> bool:
    return _STATE is not None


def simulating() -> bool:
    """True when the CPU stands in for CUDA under the check (tensors carry their intended device)."""
    return _STATE is not None and _STATE.simulate


def violations() -> int:
    """How many placement errors were raised in this process (tests assert on it)."""
    return _STATE.violations if _STATE else 0


# ---- intended devices ------------------------------------------------------------------------------------------
def intended(t: Any) -> str:
    """The device type ``t`` is meant to be on: its recorded one when the CPU stands in for CUDA ("unknown" for
    a tensor the mode never saw being made, e.g. a gradient from the autograd engine: never a failure), else its
    own."""
    if simulating():
        return getattr(t, _ATTR, "unknown")
    return str(t.device.type)


def _mark(obj: Any, dev: str, index: int | None = None) -> None:
    for t in _tensors(obj):
        with contextlib.suppress(AttributeError, RuntimeError):  # e.g. a tensor subclass without a __dict__
            setattr(t, _ATTR, dev)
            if index is not None:
                setattr(t, _INDEX_ATTR, index)


def _tensors(obj: Any, depth: int = 0, limit: int = 2) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < limit and isinstance(obj, list | tuple):
        for x in obj:
            yield from _tensors(x, depth + 1, limit)
    elif depth < limit and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1, limit)


def _cuda_index(dev: Any) -> int | None:
    """The ordinal a CUDA device request names ("cuda:1", torch.device("cuda", 1), 1), None when it names none."""
    import torch

    if isinstance(dev, bool):
        return None
    if isinstance(dev, int):
        return dev
    if isinstance(dev, str) and dev.startswith("cuda:"):
        return int(dev.split(":", 1)[1])
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return dev.index
    return None


def is_cuda_device(dev: Any) -> bool:
    """``dev`` names a CUDA device: "cuda[:n]", a cuda torch.device, or a bare ordinal (what
    ``torch.cuda.current_device()`` returns)."""
    import torch

    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda" or (dev.type == "cpu" and dev.index == _STANDIN_INDEX and simulating())
    return isinstance(dev, int) and not isinstance(dev, bool)


def _is_cpu_device(dev: Any) -> bool:
    import torch

    return (isinstance(dev, str) and dev.startswith("cpu")) or (isinstance(dev, torch.device) and dev.type == "cpu"
                                                                and not is_cuda_device(dev))


def needs_accelerator(group: Any = None) -> bool:
    """Whether collectives on ``group`` need GPU tensors (NCCL/RCCL; the check's stand-in groups)."""
    if _STATE is not None and _STATE.simulate:
        return _STATE.group_device.get(group, "cuda") == "cuda"
    import torch.distributed as dist

    return "nccl" in str(dist.get_backend(group)).lower()


# ---- the CUDA -> CPU redirect (and recorder) ---------------------------------------------------------------------
def _make_mode_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    tensor_type, tensor_cuda, tensor_to, tensor_cpu = torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.to, \
        torch.Tensor.cpu
    setitem = torch.Tensor.__setitem__

    def _moved(t: Any, index: int | None = None) -> Any:
        """A CUDA "copy" of ``t`` on the CPU: a fresh alias, recorded as CUDA (``t`` itself stays as it was)."""
        if isinstance(t, torch.nn.Parameter):
            # Module.cuda()/.to() then set ``param.data`` to the result, which no mode sees: move the record.
            _mark(t, "cuda", index)
        try:
            alias = t.view_as(t)
        except RuntimeError:
            alias = t
        _mark(alias, "cuda", index)
        return alias

    class CudaOnCpu(TorchFunctionMode):
        """``device='cuda'`` requests go to the CPU, ``.cuda()`` is a no-op and ``Tensor.type()`` answers with the
        CUDA name Megatron checks for; under the check, each tensor's intended device is recorded on the way."""

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            track = simulating()
            if func is tensor_type and len(args) == 1 and not kwargs:
                name = func(*args)
                if track and getattr(args[0], _ATTR, None) == "cpu":
                    return name
                return _CUDA_TYPE_NAMES.get(name, name)
            if func is tensor_cuda:
                return _moved(args[0], _cuda_index(args[1]) if len(args) > 1 else None) if track else args[0]
            if func is tensor_to or func is tensor_cpu:
                return self._move(func, args, kwargs, track)
            to_cuda = "device" in kwargs and is_cuda_device(kwargs["device"])
            index = _cuda_index(kwargs["device"]) if to_cuda else None
            if to_cuda:
                kwargs = dict(kwargs, device="cpu")
            out = func(*args, **kwargs)
            if track:
                if to_cuda:
                    _mark(out, "cuda", index)
                elif _in_place(getattr(func, "__name__", "")) or func is setitem:
                    pass  # in place: the target keeps its device
                elif isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cpu":
                    # ``device=x.device`` (code that follows its input: Megatron's MoE unpermute): on a GPU that is
                    # x's CUDA device, here the CPU, so the result's device is not known from the call
                    pass
                else:
                    marks = [getattr(t, _ATTR, None) for a in (args, kwargs) for t in _tensors(a)]
                    if "cuda" in marks:
                        _mark(out, "cuda")
                    elif None not in marks:  # a factory, or CPU inputs only: a CPU tensor on a GPU too
                        _mark(out, "cpu")
                    # else an input of unknown origin (made by the autograd engine, or before the check was on)
            return out

        @staticmethod
        def _move(func: Any, args: tuple, kwargs: dict, track: bool) -> Any:
            src = args[0]
            if func is tensor_cpu:
                dev: Any = "cpu"
            else:
                dev = kwargs.get("device")
                if dev is None and len(args) > 1 and isinstance(args[1], str | int | torch.device):
                    dev = args[1]
            if is_cuda_device(dev):
                if len(args) > 1 and args[1] is dev:
                    args = (src, "cpu", *args[2:])
                if "device" in kwargs:
                    kwargs = dict(kwargs, device="cpu")
                out = func(*args, **kwargs)
                return _moved(out, _cuda_index(dev)) if track else out
            if track and _is_cpu_device(dev) and getattr(src, _ATTR, None) == "cuda":
                out = func(*args, **kwargs)
                out = out.clone() if out is src else out  # a CUDA tensor's .cpu() is a new tensor
                _mark(out, "cpu")
                return out
            out = func(*args, **kwargs)
            if track and getattr(src, _ATTR, None) == "cuda" and dev is None:
                _mark(out, "cuda")  # a dtype change keeps the device
            return out

    return CudaOnCpu


_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                                        "and", "or", "xor", "lshift", "rshift", "matmul"))


def _in_place(name: str) -> bool:
    """``add_``, ``copy_``, ``__iadd__``...: the result is the target, which keeps its device."""
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


@functools.cache
def mode_class() -> type:
    """The :class:`torch.overrides.TorchFunctionMode` class of the redirect (built lazily: torch imports late)."""
    return _make_mode_class()


def install_cuda_on_cpu() -> None:
    """Push the CUDA -> CPU redirect for the rest of the process (idempotent)."""
    global _MODE
    if _MODE is None:
        _MODE = mode_class()()
        _MODE.__enter__()


# ---- the checks --------------------------------------------------------------------------------------------------
def _caller() -> str:
    here = os.path.dirname(__file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "torch" + os.sep not in frame.filename and not frame.filename.startswith(here):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _fail(message: str) -> None:
    assert _STATE is not None
    _STATE.violations += 1
    raise DevicePlacementError(f"device check: {message} (called from {_caller()})")


def _describe(t: Any) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _wrap_collective(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        if name == "batch_isend_irecv":
            ops = bound.arguments.get("p2p_op_list") or []
            pairs = [(op.group, op.tensor) for op in ops]
        else:
            group = bound.arguments.get("group")
            pairs = [(group, t) for k, v in bound.arguments.items() if k != "group" for t in _tensors(v)]
        for group, t in pairs:
            if needs_accelerator(group) and intended(t) == "cpu":
                _fail(f"torch.distributed.{name} on a group that runs {_STATE.backend if _STATE else 'nccl'} got a "
                      f"{intended(t)} tensor {_describe(t)}; NCCL only takes CUDA tensors (build it on "
                      f"milehpc.comm.collectives.collective_device(group))")
        return original(*args, **kwargs)

    return checked


def _wrap_new_group(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        pg = original(*args, **kwargs)
        backend = sig.bind(*args, **kwargs).arguments.get("backend")
        if _STATE is not None and pg is not None:
            _STATE.group_device[pg] = "cpu" if backend is not None and "nccl" not in str(backend).lower() else "cuda"
        return pg

    return recorded


def _module_hook(module: Any, args: tuple) -> None:
    first = next(module.parameters(recurse=False), None)
    if first is None:
        return
    want = intended(first)
    if want == "unknown":
        return
    for t in _tensors(args):
        if t.is_floating_point() or t.dtype in _INDEX_DTYPES():
            got = intended(t)
            if got not in (want, "unknown"):
                _fail(f"{type(module).__name__}.forward got a {got} input {_describe(t)} while its weights are on "
                      f"{want}")


@functools.cache
def _INDEX_DTYPES() -> tuple[Any, ...]:  # noqa: N802  (a cached constant)
    import torch

    return (torch.long, torch.int32, torch.bool)


def _record_through_autograd_functions() -> None:
    """Custom autograd Functions (Megatron's TP regions, fused linears) may hand back a new tensor object (a view
    of an input returned as is), which carries no record: give it its inputs' device."""
    import torch

    original = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(cls, *args, **kwargs)
        if any(getattr(t, _ATTR, None) == "cuda" for a in (args, kwargs) for t in _tensors(a)):
            _mark(out, "cuda")
        return out

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]


# ---- NCCL's rules on every operation of a process group -----------------------------------------------------------
@dataclass
class _Pending:
    """An operation enqueued on a group that stands for NCCL: a ``wait(timeout)`` counts from ``enqueued``."""

    group: Any
    what: str
    enqueued: float
    rank: int


def work_methods(cls: type) -> tuple[str, ...]:
    """The methods of ``cls`` (torch's ``ProcessGroup`` or ``Backend`` binding) that enqueue an operation: every one
    whose signature returns ``c10d::Work``, read from the installed torch's bindings, so that a collective a newer
    torch adds is covered without a list to keep up to date."""
    names = []
    for name in dir(cls):
        if name.startswith("__"):
            continue
        doc = getattr(getattr(cls, name, None), "__doc__", None) or ""
        if "-> c10d::Work" in doc:
            names.append(name)
    return tuple(names)


def stands_for_nccl(group: Any) -> bool:
    """Whether operations on ``group`` (a ProcessGroup or a bare backend) follow NCCL's rules here: on the CPU every
    group not asked for as gloo stands for NCCL; on a GPU, the groups that run NCCL."""
    if _STATE is None:
        return False
    if _STATE.simulate:
        return _STATE.group_device.get(group, "cuda") == "cuda"
    try:
        return "nccl" in str(group.name()).lower()
    except Exception:  # noqa: BLE001 - a backend without a name: not NCCL
        return False


def _device_of(t: Any) -> tuple[str, int | None]:
    """(device type, ordinal or None) a tensor is meant to be on (see :func:`intended`)."""
    if simulating():
        return intended(t), getattr(t, _INDEX_ATTR, None)
    return str(t.device.type), t.device.index


def _distributed_error(message: str) -> Exception:
    import torch.distributed as dist

    return dist.DistBackendError(message)


def _check_group_op(group: Any, what: str, args: tuple, kwargs: dict) -> None:
    """NCCL's rules on one operation of ``group`` (see the module doc); raises where NCCL would."""
    assert _STATE is not None
    if group in _STATE.aborted:
        raise _distributed_error(f"{what}: NCCL communicator was aborted on rank {_rank_of(group)} "
                                 f"({_STATE.aborted[group]})")
    if group in _STATE.suspended:
        raise _distributed_error(f"{what} on a suspended NCCL communicator (ncclCommSuspend released its memory; "
                                 f"resume it first)")
    if group not in _STATE.devices_checked:  # NCCL builds the communicator at the group's first operation
        _STATE.devices_checked.add(group)
        store = _group_store(group)
        if store is not None:
            check_group_devices(store, group.size(), what=what)
    placed: set[tuple[str, int | None]] = set()
    for t in _tensors((args, kwargs), limit=4):
        dev, index = _device_of(t)
        if dev == "cpu":
            _fail(f"{what} on a group that runs {_STATE.backend} got a cpu tensor {_describe(t)}; NCCL only takes "
                  f"CUDA tensors (build it on milehpc.comm.collectives.collective_device(group))")
        if dev == "cuda" and index is not None:
            placed.add((dev, index))
    if len(placed) > 1:
        _fail(f"{what} got tensors on {len(placed)} devices ({sorted(i for _, i in placed)}); NCCL takes one device "
              f"per rank")
    if placed:
        here = f"cuda:{next(iter(placed))[1]}"
        first = _STATE.rank_device.setdefault(group, here)
        if first != here:
            _fail(f"{what} on {here}, but this rank's earlier operations on the group ran on {first}; an NCCL "
                  f"communicator has one device per rank")


def _group_store(group: Any) -> Any:
    """The store a ProcessGroup was built on (the one handed to ``_new_process_group_helper``), or None. torch
    records it per registered group wrapped in the helper's own ``PrefixStore(f"{group_name}/", store)``."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _world

    entry = _world.pg_map.get(group)
    store = entry[1] if entry else None
    return store.underlying_store if isinstance(store, PrefixStore) else store


def declare_device(store: Any, group_rank: int, device_index: int, host: str | None = None) -> None:
    """Record in a group's store (the store the group is built on: ``PrefixStore(group_name, TCPStore(...))`` for an
    update group) that member ``group_rank`` drives GPU ``device_index`` of ``host`` (default: this host). Who knows
    the GPU declares it. Today only the trainer's stage leader declares its own device (``join_update_group``):
    SGLang's schedulers join inside the engine, where milehpc cannot write, so the engines' GPUs are checked against
    SGLang's formula by tests/test_gpu_ids.py instead. :func:`check_group_devices` (run at the group's first operation under
    the device check) refuses two members on one GPU, as NCCL does when it builds the communicator."""
    store.set(f"{DEVICE_KEY}{group_rank}", f"{host or socket.gethostname()}/{int(device_index)}")


def declared_devices(store: Any, world_size: int) -> dict[int, str]:
    """The members' declared devices ("host/index") found in ``store`` (members that declared nothing are left out;
    the look-up does not wait for them)."""
    found = {}
    for rank in range(world_size):
        key = f"{DEVICE_KEY}{rank}"
        if store.check([key]):
            found[rank] = store.get(key).decode()
    return found


def check_group_devices(store: Any, world_size: int, *, what: str = "process group") -> None:
    """Raise :class:`DevicePlacementError` if two members of a group declared one GPU of one host: NCCL's
    communicator init fails then ("Duplicate GPU detected: rank i and rank j both on CUDA device ...")."""
    seen: dict[str, int] = {}
    for rank, dev in sorted(declared_devices(store, world_size).items()):
        if dev in seen:
            message = (f"{what}: ranks {seen[dev]} and {rank} of the group are both on GPU {dev}; NCCL refuses a "
                       f"communicator with two ranks on one device (Duplicate GPU detected)")
            if _STATE is not None:
                _fail(message)
            raise DevicePlacementError(f"device check: {message}")
        seen[dev] = rank


def suspend(group: Any) -> None:
    """The stand-in of ``Backend.suspend()`` for a group that stands for NCCL on the CPU: its memory counts as
    released, and every operation on it fails until :func:`resume` (as on a suspended NCCL communicator)."""
    assert _STATE is not None and stands_for_nccl(group)
    _STATE.suspended.add(group)


def resume(group: Any) -> None:
    """The stand-in of ``Backend.resume()`` (see :func:`suspend`)."""
    assert _STATE is not None
    _STATE.suspended.discard(group)


def _wrap_group_op(kind: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not stands_for_nccl(self):
            return original(self, *args, **kwargs)
        what = f"{kind}.{name}"
        _check_group_op(self, what, args, kwargs)
        work = original(self, *args, **kwargs)
        if work is not None and _STATE is not None and _STATE.simulate:
            _STATE.works[work] = _Pending(self, what, time.monotonic(), _rank_of(self))
        return work

    return checked


def _rank_of(group: Any) -> int:
    try:
        return int(group.rank())
    except Exception:  # noqa: BLE001
        return -1


def _abort(pending: _Pending, elapsed: float) -> str:
    """What ``WorkNCCL::wait`` does past its timeout: record the error, abort the communicator (every later
    operation on the group fails), and hand back the message it throws."""
    assert _STATE is not None
    message = (f"[Rank {pending.rank}] Watchdog caught collective operation timeout: {pending.what} ran for "
               f"{elapsed * 1000:.0f} milliseconds before timing out (device check: an NCCL wait timeout counts from "
               f"the enqueue and aborts the communicator)")
    _STATE.aborted.setdefault(pending.group, message)
    return message


def _wrap_work(original_wait: Callable[..., Any], original_done: Callable[..., Any]) -> tuple[Callable[..., Any],
                                                                                           Callable[..., Any]]:
    from datetime import timedelta

    def failure(work: Any) -> str | None:
        pending = _STATE.works.get(work) if _STATE is not None else None
        return None if pending is None else _STATE.aborted.get(pending.group) if _STATE else None

    def wait(self: Any, timeout: timedelta = timedelta(0)) -> Any:
        pending = _STATE.works.get(self) if _STATE is not None else None
        if pending is None:
            return original_wait(self, timeout)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
        if seconds > 0:  # WorkNCCL: blocks the CPU until done or ``timeout`` after the enqueue, then aborts
            while not original_done(self):
                if pending.group in _STATE.aborted:  # type: ignore[union-attr]
                    break
                elapsed = time.monotonic() - pending.enqueued
                if elapsed >= seconds:
                    raise _distributed_error(_abort(pending, elapsed))
                time.sleep(0.002)
        why = failure(self)
        if why is not None:
            raise _distributed_error(why)
        return original_wait(self)

    def is_completed(self: Any) -> bool:
        return failure(self) is not None or bool(original_done(self))

    return wait, is_completed


def _install_group_rules() -> None:
    """Wrap every operation of torch's ProcessGroup and Backend bindings, and ``Work.wait`` / ``is_completed``."""
    import torch._C._distributed_c10d as c10d
    from torch.distributed import distributed_c10d

    assert _STATE is not None
    for kind, cls in (("ProcessGroup", c10d.ProcessGroup), ("Backend", c10d.Backend)):
        for name in work_methods(cls):
            original = getattr(cls, name)
            _STATE.originals[f"{kind}.{name}"] = original
            setattr(cls, name, _wrap_group_op(kind, name, original))
    work = c10d.Work
    _STATE.originals["Work.wait"], _STATE.originals["Work.is_completed"] = work.wait, work.is_completed
    work.wait, work.is_completed = _wrap_work(work.wait, work.is_completed)  # type: ignore[method-assign]
    if _STATE.simulate:
        object_device = distributed_c10d._get_object_coll_device

        def object_coll_device(group: Any = None) -> str:
            # torch puts an object collective's tensors on CUDA for an NCCL group; under the redirect (this
            # thread's mode stack) so can the stand-in, elsewhere the CPU is all there is.
            import torch

            pg = group or distributed_c10d._get_default_group()
            if torch._C._len_torch_function_stack() and stands_for_nccl(pg):
                return "cuda"
            return object_device(group)

        distributed_c10d._get_object_coll_device = object_coll_device  # type: ignore[assignment]


def enable(backend: str = "nccl") -> None:
    """Turn the checks on for this process (idempotent). On a machine without CUDA the CPU stands in for it:
    the redirect records intended devices and ``torch.cuda.current_device()`` answers 0, as on a GPU."""
    global _STATE
    if _STATE is not None:
        return
    import torch
    import torch.distributed as dist

    simulate = not torch.cuda.is_available()
    _STATE = _State(backend, simulate)
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            _STATE.originals[name] = original
            setattr(dist, name, _wrap_collective(name, original))
    _STATE.originals["new_group"] = dist.new_group
    dist.new_group = _wrap_new_group(dist.new_group)  # type: ignore[assignment]
    _install_group_rules()
    torch.nn.modules.module.register_module_forward_pre_hook(_module_hook)
    if simulate:
        _record_through_autograd_functions()
        # Megatron allocates with device=torch.cuda.current_device(). The answer must work without the redirect
        # too (backward runs outside the mode) and still mean CUDA to it: cpu:0, a device no other code names.
        standin = torch.device("cpu", _STANDIN_INDEX)
        torch.cuda.current_device = lambda: standin  # type: ignore[assignment,return-value]
        install_cuda_on_cpu()


def enable_if_requested() -> bool:
    """:func:`enable` when ``MILEHPC_DEVICE_CHECK`` asks for it; returns whether the check is on."""
    backend = requested()
    if backend:
        enable(backend)
    return enabled()


def compute_device() -> Any:
    """The device a trainer puts its model on: CUDA when there is one or when the check stands in for it."""
    import torch

    if simulating():
        return torch.device("cuda", 0)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
