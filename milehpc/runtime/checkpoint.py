"""Atomic, checksummed checkpoints of everything that determines a run's future, and finding one to resume.

Layout of ``<checkpoint.dir>`` (default ``RUN_DIR/checkpoints``)::

    step-00000040/               a complete checkpoint (only complete ones carry this name)
        rank-00000.pt            rank 0's state: {"state": what the loop gave, "rng": python/numpy/torch RNG}
        rank-00000.h5            rank 0's sample buffers (pending / partial rollouts, async buffer), if any
        rank-00001.pt ...        one shard per rank, as trained (never gathered)
        rank-00000.sums.json     each rank's checksums of its own files (merged into the manifest)
        manifest.json            written last: format, step, layout, meta, sha256 + size of every file
    .tmp-step-00000050/          a checkpoint being written (or half-written by a job that was killed)

Writing is a collective over all ranks (:meth:`Checkpointer.save`): rank 0 clears and creates the temporary
directory; every rank writes and fsyncs its files and its checksums; rank 0 merges the checksums into
``manifest.json`` (written last, fsynced), renames the directory to ``step-N`` (atomic on POSIX file systems),
fsyncs the parent and deletes all but the newest ``keep``. A job killed at any moment leaves either the
previous complete checkpoints untouched or a new complete one — never a damaged ``step-N``.

Resuming (:meth:`Checkpointer.find_latest`) takes the newest ``step-N`` whose manifest is valid and whose files
all exist with the recorded sizes; every rank then verifies the sha256 of its own files, so verification is
spread over the ranks, and if any rank finds a mismatch all ranks fall back to the next older checkpoint.
Half-written ones are skipped with a warning. The manifest's layout record (parallel layout + model shape) must
match the job's, else one clear line refuses the resume — unless the backend says it can reshard.

Login-node code imports this module (``milehpc submit --resume``): torch, numpy and h5py are imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from milehpc.errors import ConfigError, MilehpcError, RuntimeFailure
from milehpc.runtime.hygiene import make_private_dir, storage_errors
from milehpc.runtime.signals import RequestWatcher, RequeueExit, restart_count

if TYPE_CHECKING:
    from milehpc.config.job import CheckpointSpec, JobSpec
    from milehpc.plan import Plan
    from milehpc.rollout.sample import Sample

log = logging.getLogger("milehpc.checkpoint")

FORMAT = 1
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def rank_file(rank: int, suffix: str) -> str:
    return f"rank-{rank:05d}.{suffix}"


# ---- collectives -----------------------------------------------------------------------------------------


class Collective(Protocol):
    """The two collectives checkpointing needs; every call has a timeout and says what it waited for."""

    rank: int
    size: int

    def barrier(self, what: str) -> None: ...

    def allreduce_max(self, values: list[int], what: str) -> list[int]: ...


class Solo:
    """A world of one process."""

    rank = 0
    size = 1

    def barrier(self, what: str) -> None:
        return None

    def allreduce_max(self, values: list[int], what: str) -> list[int]:
        return list(values)


class MPICollective:
    """mpi4py non-blocking collectives polled until a timeout, so a dead rank ends the wait with a message
    instead of a hang."""

    def __init__(self, comm: Any, timeout_s: float = 600.0) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout_s = timeout_s

    def _wait(self, request: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0005
        while not request.Test():
            if time.monotonic() > deadline:
                raise RuntimeFailure(
                    f"rank {self.rank}: {what}: no answer from the other {self.size - 1} rank(s) within "
                    f"{self.timeout_s:g} s (a rank died or is stuck; see its log)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def barrier(self, what: str) -> None:
        self._wait(self.comm.Ibarrier(), what)

    def allreduce_max(self, values: list[int], what: str) -> list[int]:
        import numpy as np
        from mpi4py import MPI

        send = np.asarray(values, dtype=np.int64)
        recv = np.empty_like(send)
        self._wait(self.comm.Iallreduce(send, recv, op=MPI.MAX), what)
        return [int(v) for v in recv]


class CommsCollective:
    """The runtime's timed helpers (``milehpc.runtime.comm.Comms``): they end early when the watchdog saw a
    rank die and name the ranks that did not answer."""

    def __init__(self, comms: Any, timeout_s: float | None = None) -> None:
        self.comms = comms
        self.rank = comms.rank
        self.size = comms.size
        self.timeout_s = timeout_s

    def barrier(self, what: str) -> None:
        self.comms.barrier(what=what, timeout=self.timeout_s)

    def allreduce_max(self, values: list[int], what: str) -> list[int]:
        rows = self.comms.allgather(list(values), what=what, timeout=self.timeout_s)
        return [max(col) for col in zip(*rows, strict=True)]


def collective_for(comms: Any, timeout_s: float | None = None) -> Collective:
    """The collective over every rank of a job: its Comms' timed helpers, a bare mpi4py communicator, or a
    single process."""
    if comms is None or getattr(comms, "size", 1) == 1 and not hasattr(comms, "Get_size"):
        return Solo()
    if hasattr(comms, "allgather") and hasattr(comms, "plan"):
        return CommsCollective(comms, timeout_s)
    if comms.Get_size() == 1:
        return Solo()
    return MPICollective(comms, timeout_s or 600.0)


# ---- files -----------------------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _torch_save_durable(obj: Any, path: Path) -> None:
    """torch.save + fsync. torch turns a failed write (disk full) into a RuntimeError while closing its zip
    writer; hand the underlying OSError on so the caller reports it with the path."""
    import torch

    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        except RuntimeError as err:
            cause = err.__context__ or err.__cause__
            if isinstance(cause, OSError):
                cause.filename = cause.filename or str(path)
                raise cause from err
            raise


# ---- RNG -------------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (CPU, and every CUDA/ROCm device) RNG states of this process, in types
    ``torch.load(weights_only=True)`` accepts."""
    import numpy as np
    import torch

    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def derive_rng(seed: int, rank: int, step: int) -> None:
    """Seed python/numpy/torch from (seed, rank, step): a rank resumed at another layout has no saved stream."""
    import numpy as np
    import torch

    value = ((seed * 1_000_003 + rank) * 1_000_003 + step) % (2**63)
    random.seed(value)
    np.random.seed(value % (2**32))
    torch.manual_seed(value)


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- sample buffers in HDF5 (lossless) -------------------------------------------------------------------

# Ragged per-sample lists: flat data + offsets. Logprobs stay float64 (Python floats) so a resumed run
# trains on exactly the numbers the uninterrupted one would have.
_RAGGED = {"prompt_ids": "int64", "response_ids": "int64", "rollout_logprobs": "float64", "loss_mask": "int8"}
_SCALARS = ("group", "index", "weight_version")
_JSON_FIELDS = ("reward", "label", "prompt_text", "response_text", "metadata", "routed_experts")


def write_samples_h5(path: Path, buffers: dict[str, list[Sample] | list[list[Sample]]]) -> None:
    """Write named sample buffers (e.g. ``pending``, ``partial``, ``async_buffer``) to one HDF5 file, one group
    per buffer, losslessly; fsynced. A buffer is a list of samples or a list of groups (lists of samples)."""
    import h5py
    import numpy as np

    strings = h5py.string_dtype()
    with h5py.File(path, "w") as f:
        for name, buffer in buffers.items():
            g = f.create_group(name)
            nested = bool(buffer) and isinstance(buffer[0], list)
            samples = [s for grp in buffer for s in grp] if nested else list(buffer)
            if nested:
                g.create_dataset("group_sizes", data=np.asarray([len(grp) for grp in buffer], dtype=np.int64))
            g.attrs["count"] = len(samples)
            for key, dtype in _RAGGED.items():
                rows = [getattr(s, key) for s in samples]
                g.create_dataset(key, data=np.asarray([x for r in rows for x in r], dtype=dtype))
                g.create_dataset(f"{key}_offsets", data=np.cumsum([0, *map(len, rows)]).astype(np.int64))
            for key in _SCALARS:
                g.create_dataset(key, data=np.asarray([getattr(s, key) for s in samples], dtype=np.int64))
            g.create_dataset("status", data=[s.status.value for s in samples], dtype=strings)
            try:
                extra = [json.dumps({k: getattr(s, k) for k in _JSON_FIELDS}) for s in samples]
            except TypeError as err:
                raise RuntimeFailure(f"buffer {name!r}: a sample's label/metadata is not JSON-serialisable ({err})") from None
            g.create_dataset("extra", data=extra, dtype=strings)
    fsync_path(path)


def read_samples_h5(path: Path) -> dict[str, list[Sample] | list[list[Sample]]]:
    """Inverse of :func:`write_samples_h5`."""
    import h5py
    import numpy as np

    from milehpc.rollout.sample import Sample, Status

    out: dict[str, list[Sample]] = {}
    with h5py.File(path, "r") as f:
        for name, g in f.items():
            n = int(g.attrs["count"])
            ragged = {}
            for key in _RAGGED:
                flat, off = g[key][()].tolist(), g[f"{key}_offsets"][()].tolist()
                ragged[key] = [flat[off[i]:off[i + 1]] for i in range(n)]
            scalars = {key: g[key][()].tolist() for key in _SCALARS}
            status = [x.decode() if isinstance(x, bytes) else x for x in g["status"][()]]
            extra = [json.loads(x) for x in g["extra"][()]]
            flat = [
                Sample(**{k: ragged[k][i] for k in _RAGGED}, **{k: scalars[k][i] for k in _SCALARS},
                       status=Status(status[i]), **extra[i])
                for i in range(n)
            ]
            if "group_sizes" in g:
                bounds = np.cumsum([0, *g["group_sizes"][()].tolist()]).tolist()
                out[name] = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            else:
                out[name] = flat
    return out


# ---- layout compatibility --------------------------------------------------------------------------------

_MODEL_KEYS = ("arch", "path", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
               "vocab_size", "num_experts", "tie_word_embeddings")
_PARALLEL_KEYS = ("world_size", "trainer_ranks", "tp", "pp", "dp", "ep", "rollout_ranks", "engines",
                  "gpus_per_engine", "colocated", "trainer_backend")


def layout_record(job: JobSpec, plan: Plan) -> dict[str, Any]:
    """What a checkpoint's shards depend on: the rank layout and the model's shape."""
    par = {k: getattr(plan, k) for k in _PARALLEL_KEYS if hasattr(plan, k)}
    par["trainer_backend"] = job.trainer.backend
    return {"parallel": par, "model": {k: getattr(job.model, k) for k in _MODEL_KEYS}}


def _diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [f"{k}={saved.get(k)!r}->{current.get(k)!r}" for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)]


def check_layout(saved: dict[str, Any] | None, current: dict[str, Any] | None, *, where: str,
                 can_reshard: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None) -> bool:
    """Raise one clear ConfigError if a checkpoint written with layout ``saved`` cannot be loaded by a job
    with layout ``current``. Returns True when the layouts differ but ``can_reshard`` accepted them."""
    if saved is None or current is None:
        return False
    model = _diff(saved.get("model", {}), current.get("model", {}))
    if model:
        raise ConfigError(f"checkpoint is of a different model ({', '.join(model)}); "
                          "resume it with the model it was trained with, or start a new run dir", file=where)
    par = _diff(saved.get("parallel", {}), current.get("parallel", {}))
    if not par:
        return False
    if can_reshard is not None and can_reshard(saved["parallel"], current["parallel"]):
        return True
    raise ConfigError(f"checkpoint was written with another rank layout ({', '.join(par)}) and the "
                      f"{current.get('parallel', {}).get('trainer_backend', '?')} trainer cannot reshard it; "
                      "resume with the original layout or start a new run dir", file=where)


def reshard_check(job: JobSpec) -> Callable[[dict[str, Any], dict[str, Any]], bool] | None:
    """The job's trainer plugin's ``can_reshard`` (see :class:`milehpc.plugin_types.Trainer`), or None when the
    trainer resumes only at the layout it saved (or is unknown here: then the layout check refuses)."""
    from milehpc import plugins
    from milehpc.plugin_types import load_ref

    try:
        spec = plugins.lookup("trainer", job.trainer.backend)
    except MilehpcError:
        return None
    ref = getattr(spec, "can_reshard", None)
    return None if ref is None else load_ref(ref)


# ---- the checkpointer ------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})


@dataclass
class Restored:
    """One rank's share of a checkpoint. Call :meth:`apply_rng` last, once everything is rebuilt."""

    info: CheckpointInfo
    state: dict[str, Any]
    rng: dict[str, Any] | None
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    resharded: bool = False

    def apply_rng(self) -> None:
        if self.rng is not None:
            restore_rng(self.rng)


@dataclass
class Decision:
    """What to do at a step boundary; identical on every rank (agreed by one allreduce)."""

    save: bool = False
    stop: bool = False  # checkpoint, then exit with signals.EXIT_REQUEUE
    reasons: list[str] = field(default_factory=list)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, or None when it is missing, unreadable or not ours."""
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return None
    return data


def _files_present(path: Path, manifest: dict[str, Any]) -> str | None:
    """None if every file of the manifest exists with its recorded size, else what is wrong."""
    for name, rec in manifest["files"].items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != rec.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {rec.get('bytes')}"
    return None


def list_checkpoints(root: Path, *, warn: bool = False) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root`` (manifest valid, all files present with their sizes), newest
    first. With ``warn``, each half-written or damaged one is reported once, with what is wrong."""
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(TMP_PREFIX):
            if warn:
                log.warning("ignoring half-written checkpoint %s (no manifest: the job stopped while writing it)",
                            entry)
            continue
        if not entry.name.startswith(STEP_PREFIX) or not entry.is_dir():
            continue
        manifest = read_manifest(entry)
        problem = "no valid manifest" if manifest is None else _files_present(entry, manifest)
        if problem:
            if warn:
                log.warning("ignoring incomplete checkpoint %s (%s)", entry, problem)
            continue
        found.append(CheckpointInfo(entry, int(manifest["step"]), manifest))
    return sorted(found, key=lambda c: c.step, reverse=True)


class Checkpointer:
    """Periodic, on-demand and final checkpoints of one job; a collective object (every rank makes the same
    calls in the same order).

    ``interval_steps`` and ``interval_s`` (rank 0's clock) make :meth:`at_step_end` ask for a save; a requeue
    request (see :mod:`milehpc.runtime.signals`) asks for a save and a stop.
    """

    def __init__(self, root: str | os.PathLike[str], *, coll: Collective | None = None, keep: int = 2,
                 interval_steps: int = 0, interval_s: float = 0.0, layout: dict[str, Any] | None = None,
                 dir_mode: str = "0700", can_reshard: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root)
        self.coll = coll or Solo()
        self.keep = max(1, keep)
        self.interval_steps = interval_steps
        self.interval_s = interval_s
        self.layout = layout
        self.dir_mode = dir_mode
        self.can_reshard = can_reshard
        self.clock = clock
        self.last_save = clock()
        self.saves = 0

    @classmethod
    def for_job(cls, job: JobSpec, plan: Plan | None, run_dir: str | os.PathLike[str], *,
                coll: Collective | None = None, **kwargs: Any) -> Checkpointer:
        spec: CheckpointSpec = job.checkpoint
        kwargs.setdefault("can_reshard", reshard_check(job))
        return cls(checkpoint_root(job, run_dir), coll=coll, keep=spec.keep, interval_steps=spec.interval_steps,
                   interval_s=spec.interval_minutes * 60.0,
                   layout=layout_record(job, plan) if plan is not None else None,
                   dir_mode=job.run.dir_mode, **kwargs)

    # ---- when ------------------------------------------------------------------------------------------
    def at_step_end(self, step: int, *, requested: bool = False, last: bool = False) -> Decision:
        """Agree across ranks whether to checkpoint (and stop) after ``step`` (1-based count of finished
        steps). ``requested``: this rank saw a requeue request (usually only rank 0 polls for it)."""
        flags = self.coll.allreduce_max(self._flags(step, requested, last),
                                        f"step {step}: agreeing on checkpoint/requeue")
        return self._decision(flags)

    def decide(self, step: int, *, requested: bool = False, last: bool = False) -> Decision:
        """This rank's decision alone (for a caller that distributes it itself)."""
        return self._decision(self._flags(step, requested, last))

    def _flags(self, step: int, requested: bool, last: bool) -> list[int]:
        interval = bool(self.interval_steps) and step % self.interval_steps == 0
        # Only rank 0's clock counts: the ranks' clocks would disagree near the deadline.
        timed = self.coll.rank == 0 and self.interval_s > 0 and self.clock() - self.last_save >= self.interval_s
        return [int(interval), int(timed), int(requested), int(last)]

    def _decision(self, flags: list[int]) -> Decision:
        names = (f"every {self.interval_steps} steps", f"every {self.interval_s:g} s", "requeue requested",
                 "end of run")
        reasons = [n for n, f in zip(names, flags, strict=True) if f]
        return Decision(save=any(flags), stop=bool(flags[2]) and not flags[3], reasons=reasons)

    # ---- save ------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, samples: dict[str, list[Sample]] | None = None,
             meta: dict[str, Any] | None = None) -> Path:
        """Collective: write this rank's ``state`` (torch-serialisable: tensors, numbers, strings, lists,
        dicts) and ``samples`` buffers; rank 0's ``meta`` (weight version, metric step, data cursor...) goes
        into the manifest. Returns the final directory."""
        rank = self.coll.rank
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}"
        final = self.root / step_dir_name(step)

        def prepare() -> None:
            with storage_errors(self.root):
                make_private_dir(self.root, self.dir_mode)
                if tmp.exists():  # left by a job killed while writing this very step
                    shutil.rmtree(tmp)
                tmp.mkdir(mode=0o700)

        def write_shard() -> None:
            sums: dict[str, dict[str, Any]] = {}
            with storage_errors(tmp):
                pt = tmp / rank_file(rank, "pt")
                _torch_save_durable({"format": FORMAT, "step": step, "rank": rank, "state": state,
                                     "rng": capture_rng()}, pt)
                written = [pt]
                if samples:
                    h5 = tmp / rank_file(rank, "h5")
                    write_samples_h5(h5, samples)
                    written.append(h5)
                for path in written:
                    sums[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
                write_json_durable(tmp / rank_file(rank, "sums.json"), sums)
                fsync_path(tmp)

        def commit() -> None:
            with storage_errors(tmp):
                self._commit(tmp, final, step, meta or {})

        self._phase(step, f"creating {tmp}", prepare if rank == 0 else None)
        self._phase(step, "writing every rank's shard", write_shard)
        self._phase(step, "rank 0 commits", commit if rank == 0 else None)
        self.last_save = self.clock()
        self.saves += 1
        return final

    def _phase(self, step: int, what: str, work: Callable[[], None] | None) -> None:
        """Run this rank's part of one phase, then agree that every rank's part succeeded: a rank whose disk
        is full raises its own one-line error, the others say which rank failed (nobody waits for a timeout)."""
        error: BaseException | None = None
        if work is not None:
            try:
                work()
            except Exception as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
                error = err
        failed = self.coll.allreduce_max([self.coll.rank if error is not None else -1],
                                         f"checkpoint step {step}: {what}")[0]
        if error is not None:
            raise error
        if failed >= 0:
            raise RuntimeFailure(f"checkpoint step {step} not written: {what} failed on rank {failed} "
                                 "(see its message); the previous checkpoint is intact")

    def _commit(self, tmp: Path, final: Path, step: int, meta: dict[str, Any]) -> None:
        files: dict[str, Any] = {}
        for r in range(self.coll.size):
            sums_path = tmp / rank_file(r, "sums.json")
            try:
                files.update(json.loads(sums_path.read_text(encoding="utf-8")))
            except (OSError, ValueError) as err:
                raise RuntimeFailure(f"checkpoint step {step}: rank {r} wrote no checksums ({err})") from err
        manifest = {"format": FORMAT, "step": step, "world_size": self.coll.size, "created": time.time(),
                    "layout": self.layout, "meta": meta, "files": files}
        write_json_durable(tmp / MANIFEST, manifest)
        fsync_path(tmp)
        old = None
        if final.exists():  # the run was resumed from an older checkpoint and reached this step again
            old = final.with_name(_OLD_PREFIX + final.name)
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        complete = list_checkpoints(self.root)
        for info in complete[self.keep:]:
            shutil.rmtree(info.path, ignore_errors=True)
        for entry in self.root.iterdir():
            if entry.name.startswith((TMP_PREFIX, _OLD_PREFIX)) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)  # leftovers of killed jobs; never in progress here

    # ---- resume ----------------------------------------------------------------------------------------
    def find_latest(self, sources: Callable[[CheckpointInfo], list[int]] | None = None) -> CheckpointInfo | None:
        """Collective: the newest checkpoint that is complete, fits the layout and whose every file checks out
        on the rank that reads it (``sources(info)``: the saved ranks whose shards this rank will load; default
        its own). None when there is none."""
        coll = self.coll
        candidates = list_checkpoints(self.root, warn=coll.rank == 0)
        tried: set[int] = set()
        while True:
            mine = next((c for c in candidates if c.step not in tried), None)
            # Rank 0's listing decides, so every rank opens the same directory.
            (step,) = coll.allreduce_max([mine.step if (mine and coll.rank == 0) else -1],
                                         "resume: agreeing on the checkpoint")
            if step < 0:
                return None
            tried.add(step)
            info = next((c for c in candidates if c.step == step), None)
            if info is not None:  # refuse (one line) before reading shards a changed layout cannot use
                check_layout(info.manifest.get("layout"), self.layout, where=str(info.path / MANIFEST),
                             can_reshard=self.can_reshard)
            problem = "not visible on this rank" if info is None else \
                self._verify_own(info, sources(info) if sources is not None else [coll.rank])
            (bad,) = coll.allreduce_max([int(problem is not None)], f"resume: verifying checkpoint step {step}")
            if bad:
                if problem:
                    log.warning("rank %d: checkpoint %s is damaged (%s)", coll.rank,
                                info.path if info else step, problem)
                if coll.rank == 0:
                    log.warning("skipping damaged checkpoint step %d, trying an older one", step)
                continue
            assert info is not None
            return info

    def _own_files(self, info: CheckpointInfo, rank: int) -> list[str]:
        prefix = rank_file(rank, "")
        return [name for name in info.manifest["files"] if name.startswith(prefix)]

    def _verify_own(self, info: CheckpointInfo, ranks: list[int]) -> str | None:
        for name in [n for r in ranks for n in self._own_files(info, r)]:
            if sha256_file(info.path / name) != info.manifest["files"][name]["sha256"]:
                return f"{name}: sha256 mismatch"
        return None

    def load(self, info: CheckpointInfo, *, source_rank: int | None = None) -> Restored:
        """This rank's share of checkpoint ``info`` (or ``source_rank``'s, when resharding)."""
        import torch

        rank = self.coll.rank if source_rank is None else source_rank
        pt = info.path / rank_file(rank, "pt")
        if rank_file(rank, "pt") not in info.manifest["files"]:
            raise ConfigError(f"checkpoint has no shard for rank {rank} (it was written by "
                              f"{info.manifest.get('world_size')} ranks)", file=str(info.path))
        with storage_errors(pt, doing="reading"):
            payload = torch.load(pt, map_location="cpu", weights_only=True)
            h5 = info.path / rank_file(rank, "h5")
            samples = read_samples_h5(h5) if rank_file(rank, "h5") in info.manifest["files"] else {}
        saved_layout = info.manifest.get("layout")
        resharded = bool(self.layout and saved_layout and saved_layout != self.layout)
        return Restored(info, payload["state"], payload.get("rng"), samples, resharded)

    def resume(self) -> Restored | None:
        """Collective: load this rank's share of the newest usable checkpoint, or None."""
        info = self.find_latest()
        if info is None:
            return None
        if self.coll.rank == 0:
            log.info("resuming from %s (step %d)", info.path, info.step)
        return self.load(info)


def checkpoint_root(job: JobSpec, run_dir: str | os.PathLike[str]) -> Path:
    """``checkpoint.dir`` (relative paths are relative to the run dir) or ``RUN_DIR/checkpoints``."""
    run_dir = Path(run_dir)
    if job.checkpoint.dir:
        path = Path(os.path.expandvars(os.path.expanduser(job.checkpoint.dir)))
        return path if path.is_absolute() else run_dir / path
    return run_dir / "checkpoints"


def resume_run_dir(run_dir: str | os.PathLike[str], *, job: JobSpec | None = None,
                   plan: Plan | None = None) -> dict[str, Any]:
    """For ``milehpc submit --resume RUN_DIR`` (login node, no torch): check that ``RUN_DIR`` is a milehpc run
    dir and that its newest complete checkpoint fits the layout the job will run with (``job``/``plan`` when the
    caller re-planned it, e.g. ``--set trainer.tp=2``, else the run dir's own job.json/plan.json) or that the
    trainer can reshard it, and say what the resubmitted job will resume from. Returns ``{"run_dir",
    "job_script", "checkpoint" (path or None), "step" (or None), "meta", "resharded" (bool)}``; raises a
    one-line MilehpcError otherwise. The ranks then resume by themselves (``checkpoint.resume``)."""
    from milehpc.config.job import JobSpec
    from milehpc.config.schema import build
    from milehpc.plan import Plan

    run_dir = Path(run_dir).resolve()
    job_json = run_dir / "job.json"
    if not job_json.is_file():
        raise MilehpcError("not a milehpc run dir (no job.json); give the directory `milehpc submit` created",
                           file=str(run_dir))
    try:
        if job is None:
            job = build(JobSpec, json.loads(job_json.read_text(encoding="utf-8")), file=str(job_json))
        if plan is None:
            plan = Plan.from_dict(json.loads((run_dir / "plan.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as err:
        raise MilehpcError(f"cannot read the run's job/plan ({err.__class__.__name__}: {err})",
                           file=str(run_dir)) from None
    if not job.checkpoint.resume:
        raise ConfigError("checkpoint.resume is false in this run's job; set it true to resume",
                          file=str(job_json), field="checkpoint.resume")
    root = checkpoint_root(job, run_dir)
    found = list_checkpoints(root, warn=True)
    out: dict[str, Any] = {"run_dir": str(run_dir), "job_script": str(run_dir / "job.sbatch"),
                           "checkpoint": None, "step": None, "meta": {}, "resharded": False}
    if found:
        newest = found[0]
        resharded = check_layout(newest.manifest.get("layout"), layout_record(job, plan),
                                 where=str(newest.path / MANIFEST), can_reshard=reshard_check(job))
        out.update(checkpoint=str(newest.path), step=newest.step, meta=newest.meta, resharded=resharded)
    return out


# ---- the RL loop's checkpointing -------------------------------------------------------------------------


class LoopCheckpoint:
    """Resume at the start and checkpoint at step boundaries for ``milehpc.runtime.loop``.

    * Colocated and single-process runs: every rank is at the same boundary; one allreduce agrees on
      interval / time / requeue-request / end-of-run checkpoints (:meth:`Checkpointer.at_step_end`).
    * Separate trainer and rollout groups: the trainer ranks call :meth:`hook` after each step; rank 0 decides
      and tells the trainer ranks (broadcast) and the rollout ranks (a ``("checkpoint", {...})`` weight notice,
      taken between generations). A rollout rank may be ahead of the trainer (it generated batches the trainer
      has not trained yet, still in flight): it keeps every batch it sent in an *outbox* until the trainer has
      trained it (a weight notice of version v means batches < v were trained); the checkpoint holds the outbox
      (HDF5), and a resumed rollout rank sends it again before generating anything new. After a resume the
      trainer pushes its weights once (the engines are rebuilt from the seeded init).

    What each rank writes: ``rank-N.pt`` = {"trainer": TrainerSide.state_dict(), "rollout": RolloutSide
    .state_dict() without its samples, "outbox": [(batch, stats)]} and ``rank-N.h5`` = the partial rollouts
    (``carry``), the over-sampled groups (``ready``) and each outbox batch (``outbox_B``).

    **Resuming at another trainer layout** (only when the trainer plugin's ``can_reshard`` accepts it, e.g.
    Megatron TP=2 x DP=1 -> TP=1 x DP=2; the rollout layout and the model never change). What is per rank and
    where a rank of the new layout takes it from (:meth:`sources`):

    * *trainer state* — loop step, weight version, SFT flag, the trainer-side async buffer (all global: every
      trainer rank holds the same values, rank 0 also the buffer) and the trainer's own small state (version,
      step count, the path of its dist checkpoint): from **trainer rank 0's** shard, on every trainer rank. The
      model and optimizer come from the trainer's layout-independent checkpoint (Megatron: dist_checkpointing,
      loaded and resharded for the new TP/PP/DP), so they are exactly the saved ones.
    * *rollout state* — data cursor, partial rollouts, over-sampled groups, outbox, engine RNG: from the saved
      rank with the **same rollout index** (the rollout ranks shift when the number of trainer ranks changes);
      these are exactly the saved ones.
    * *process RNG* (python/numpy/torch) — rollout and colocated ranks: that same rank's, exact; trainer rank 0:
      its own, exact; every other trainer rank: a new stream derived from (run.seed, rank, step), because a
      rank of another layout has no saved stream to continue (its numbers cannot be bit-identical to any
      uninterrupted run, which did not exist at this layout). The trainer keeps RNG that depends on the layout
      (Megatron's TP-rank RNG tracker) as seeded for the new layout. Steps after a resharded resume therefore
      match an uninterrupted run only up to reduction order (TP/DP sums), not bitwise.
    """

    def __init__(self, job: JobSpec, run_dir: str | os.PathLike[str], *, comms: Any = None,
                 plan: Plan | None = None) -> None:
        self.job = job
        self.run_dir = Path(run_dir)
        self.comms = comms
        self.plan = plan
        self.rank = comms.rank if comms is not None else 0
        self.ck = Checkpointer.for_job(job, plan, run_dir,
                                       coll=collective_for(comms, job.resources.collective_timeout_s))
        self.watcher = RequestWatcher(run_dir, rank=self.rank)
        self.separated = bool(plan is not None and not plan.colocated and comms is not None and comms.size > 1)
        self._notices: list[Any] = []
        self.resumed_step: int | None = None

    @classmethod
    def for_context(cls, ctx: Any) -> LoopCheckpoint:
        return cls(ctx.job, ctx.run_dir, comms=ctx.comms, plan=ctx.plan)

    # ---- resume ----------------------------------------------------------------------------------------
    def restore(self, *, trainer: Any = None, rollout: Any = None) -> bool:
        """Collective, at the start of every rank's loop: load the newest checkpoint into the sides.
        Returns True when the run resumed."""
        if rollout is not None:
            rollout.outbox = []
            rollout.checkpointing = self
        if not self.job.checkpoint.resume:
            return False
        info = self.ck.find_latest(sources=lambda i: sorted(set(self.sources(i).values())))
        if info is None:
            return False
        src = self.sources(info)
        parts = {r: self.ck.load(info, source_rank=r) for r in sorted(set(src.values()))}
        restored = parts[src.get("rollout", src.get("trainer", self.rank))]
        resharded = restored.resharded
        if trainer is not None:
            ts = parts[src["trainer"]].state["trainer"]
            if resharded:  # the trainer loads its model/optimizer at the new layout, keeps its layout's RNG
                ts = {**ts, "trainer": {**ts["trainer"], "resharded": True}}
            trainer.load_state_dict(ts)
        state, samples = restored.state, restored.samples
        if rollout is not None:
            rs = state["rollout"]
            rs["loop"]["carry"] = [s.to_dict() for s in samples.get("carry", [])]
            rs["loop"]["ready"] = [[s.to_dict() for s in g] for g in samples.get("ready", [])]
            rollout.load_state_dict(rs)
            rollout.outbox = [(b, samples[f"outbox_{b}"], stats) for b, stats in state.get("outbox", [])]
        if "rng" in src:
            parts[src["rng"]].apply_rng()
        else:
            derive_rng(self.job.run.seed, self.rank, info.step)
        self.resumed_step = info.step
        if self.rank == 0:
            how = ""
            if resharded:
                saved = info.manifest["layout"]["parallel"]
                how = (f", resharded from tp={saved.get('tp')} pp={saved.get('pp')} dp={saved.get('dp')} to "
                       f"tp={self.plan.tp} pp={self.plan.pp} dp={self.plan.dp}")
            print(f"milehpc: resumed from {info.path} (step {info.step}, restart {restart_count()}{how})",
                  flush=True)
        return True

    def sources(self, info: CheckpointInfo) -> dict[str, int]:
        """The saved ranks this rank's state comes from: ``{"trainer": r, "rollout": r, "rng": r}`` (a role
        this rank does not have is absent; no ``"rng"`` = derive a new stream). Identity at the saved layout;
        at another trainer layout see the class docstring."""
        rank, plan = self.rank, self.plan
        saved = info.manifest.get("layout")
        if plan is None or saved is None or self.ck.layout is None or saved == self.ck.layout:
            return {"trainer": rank, "rollout": rank, "rng": rank}
        par = saved["parallel"]
        out: dict[str, int] = {}
        if plan.is_trainer(rank):
            out["trainer"] = 0
            if rank == 0:
                out["rng"] = 0
        if plan.is_rollout(rank):
            # can_reshard keeps the rollout layout; only its first rank moves with the number of trainer ranks.
            first = 0 if par.get("colocated") else int(par["trainer_ranks"])
            out["rollout"] = out["rng"] = first + rank - plan.rollout_first
        return out

    # ---- the trainer ranks' (and colocated ranks') step boundary -----------------------------------------
    def hook(self, side: Any, step: int, rollout: Any = None) -> None:
        """After step ``step`` (0-based) was trained: checkpoint if due, and stop if a requeue was asked."""
        done = step + 1
        last = done >= self.job.run.steps
        requested = self.watcher.requested()
        if self.separated:
            decision = self._decide_for_groups(done, requested, last)
        else:
            decision = self.ck.at_step_end(done, requested=requested, last=last)
        if decision.save:
            self._save(done, side, rollout, decision.stop)

    def _decide_for_groups(self, done: int, requested: bool, last: bool) -> Decision:
        comms, plan = self.comms, self.plan
        trainers = list(plan.trainer_group())
        decision = self.ck.decide(done, requested=requested, last=last) if self.rank == 0 else None
        if len(trainers) > 1:
            decision = comms.bcast(decision, 0, trainers, what=f"step {done}: checkpoint decision")
        if decision.save and self.rank == 0:
            from milehpc.runtime.loop import TAG_NOTICE

            self._notices = [r for r in self._notices if not r.Test()]
            for r in plan.rollout_group():
                self._notices.append(comms.ctrl.isend(("checkpoint", {"step": done, "stop": decision.stop}),
                                                      r, TAG_NOTICE))
        return decision

    # ---- the rollout ranks' side (separate groups) -----------------------------------------------------
    def sent(self, rollout: Any, batch: int, groups: list[Any], stats: dict[str, float]) -> None:
        """A batch went to the trainer: keep it until it is trained."""
        rollout.outbox.append((batch, groups, stats))

    def trained(self, rollout: Any, version: int) -> None:
        """Weights of ``version`` arrived: the trainer has trained every batch before ``version``."""
        rollout.outbox = [o for o in rollout.outbox if o[0] >= version]

    def on_notice(self, rollout: Any, info: dict[str, Any]) -> None:
        """A checkpoint notice from trainer rank 0."""
        self.trained(rollout, int(info["step"]))
        self._save(int(info["step"]), None, rollout, bool(info["stop"]))

    # ---- writing ---------------------------------------------------------------------------------------
    def _save(self, done: int, trainer: Any, rollout: Any, stop: bool) -> None:
        from milehpc.rollout.sample import Sample

        state: dict[str, Any] = {}
        samples: dict[str, Any] = {}
        meta: dict[str, Any] = {"restart_count": restart_count(), "steps_done": done}
        if trainer is not None:
            state["trainer"] = trainer.state_dict()
            meta.update(weight_version=trainer.state.weight_version, metric_step=trainer.state.step)
        if rollout is not None:
            rs = rollout.state_dict()
            loop = rs["loop"]
            samples["carry"] = [Sample.from_dict(d) for d in loop.pop("carry")]
            samples["ready"] = [[Sample.from_dict(d) for d in g] for g in loop.pop("ready")]
            outbox = getattr(rollout, "outbox", [])
            state["rollout"] = rs
            state["outbox"] = [(b, stats) for b, _, stats in outbox]
            for b, groups, _ in outbox:
                samples[f"outbox_{b}"] = groups
            meta.setdefault("data", loop.get("data"))
        path = self.ck.save(done, state, samples=samples, meta=meta)
        if stop:
            self.watcher.acknowledge(done, path)
            if self.rank == 0:
                print(f"milehpc: checkpointed after step {done} in {path}; exiting with 75 to be requeued",
                      flush=True)
            raise RequeueExit(f"checkpointed after step {done} for a requeue")
