"""Rank entry for tests/test_ckpt_reshard_mpi.py, set as the job's ``[env] MILEHPC_ENTRY`` so that it runs through
the rendered job script: the real RL loop (``milehpc.runtime.loop:run``) with the real
:class:`~milehpc.runtime.loop.checkpointing.LoopCheckpoint`, which additionally records the trainer's weights — gathered to
full HF-named tensors by the trainer's own export — each time it checkpoints and right after it resumed, into
``RUN_DIR/probe/{saved,resumed}-STEP.pt`` (written by trainer rank 0); and the job's reward. Imported by the
ranks only."""

from __future__ import annotations

from typing import Any

from milehpc.runtime.loop.checkpointing import LoopCheckpoint


def token_reward(sample: Any) -> float:
    """A reward that differs within every group from the first step (a function of the sampled tokens), so every
    step trains and the weights at the checkpoint are not the initial ones."""
    return (sum(sample.response_ids) % 5) / 4.0


class RecordingCheckpoint(LoopCheckpoint):
    def _record(self, side: Any, kind: str, step: int) -> None:
        import torch

        named = list(side.trainer.export_weights())  # a collective over the trainer ranks (TP gathers)
        if self.rank == 0:
            out = self.run_dir / "probe"
            out.mkdir(exist_ok=True)
            torch.save({n: t.detach().clone() for n, t in named}, out / f"{kind}-{step}.pt")

    def restore(self, *, trainer: Any = None, rollout: Any = None) -> bool:
        resumed = super().restore(trainer=trainer, rollout=rollout)
        if resumed and trainer is not None:
            assert self.resumed_step is not None
            self._record(trainer, "resumed", self.resumed_step)
        return resumed

    def write(self, done: int, *, trainer: Any, rollout: Any) -> Any:  # every checkpoint write, every loop mode
        if trainer is not None:
            self._record(trainer, "saved", done)
        return super().write(done, trainer=trainer, rollout=rollout)


def run(ctx: Any) -> Any:
    from milehpc.runtime import loop

    return loop.run(ctx, checkpointing=RecordingCheckpoint.for_context(ctx))
