"""The checkpointer: periodic, on-demand and final checkpoints of one job, written collectively and atomically by
every rank, and the newest usable one found and loaded on resume (see the package docstring for the layout)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.checkpoint.collective import Collective, Solo
from milehpc.checkpoint.files import (
    FORMAT,
    MANIFEST,
    OLD_PREFIX,
    TMP_PREFIX,
    fsync_path,
    rank_file,
    sha256_file,
    step_dir_name,
    torch_save_durable,
    write_json_durable,
)
from milehpc.checkpoint.layout import check_layout, layout_record, reshard_check
from milehpc.checkpoint.manifest import CheckpointInfo, list_checkpoints
from milehpc.checkpoint.resume import checkpoint_root
from milehpc.checkpoint.rng import capture_rng, restore_rng
from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.faults import maybe_fail
from milehpc.hygiene import make_private_dir, storage_errors
from milehpc.samples.h5 import read_samples_h5, write_samples_h5

if TYPE_CHECKING:
    from milehpc.config.job import CheckpointSpec, JobSpec
    from milehpc.plan import Plan
    from milehpc.samples import Sample

log = logging.getLogger("milehpc.checkpoint")


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
                torch_save_durable({"format": FORMAT, "step": step, "rank": rank, "state": state,
                                     "rng": capture_rng()}, pt)
                written = [pt]
                if samples:
                    h5 = tmp / rank_file(rank, "h5")
                    write_samples_h5(h5, samples)
                    fsync_path(h5)
                    written.append(h5)
                for path in written:
                    sums[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
                write_json_durable(tmp / rank_file(rank, "sums.json"), sums)
                fsync_path(tmp)

        def commit() -> None:
            maybe_fail("commit", step)
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
            old = final.with_name(OLD_PREFIX + final.name)
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
            if entry.name.startswith((TMP_PREFIX, OLD_PREFIX)) and entry.is_dir():
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
