"""How a trainer cuts one rollout batch: mini-batches (one optimizer step each) and micro-batches (one forward and
backward each, gradients accumulated), shared by the torch and the Megatron trainer (issue 33 item 2).

* **Mini-batches** (``trainer.mini_batch_size``, verl's ``ppo_mini_batch_size`` x n, slime's global batch size): the
  rollout batch of ``prompts_per_step * n_samples`` samples makes ``batch / mini_batch_size`` optimizer steps. Each
  DP rank cuts its share into that many consecutive parts (fewer if a rank holds fewer samples: every rank takes as
  many steps). As in PPO, the old policy of the importance ratio is the one before the first step: its logprobs are
  computed once over the whole batch before any update, and so are the advantages; each mini-batch's loss is
  normalised by its own global counts (token-mean over the mini-batch's tokens on all DP ranks). The weight version
  and the LR schedule still advance once per rollout batch (verl steps its scheduler once per update too).
* **Micro-batches by token budget** (``trainer.max_tokens_per_micro_batch``, verl's ``ppo_max_token_len_per_gpu``):
  sequences (their prompt + response tokens) go first-fit-decreasing into bins of at most the budget (a longer one
  alone); each bin is one micro-batch, trimmed to its own widths. Every micro-batch's loss is normalised by the
  step's (mini-batch's) global counts, so their sum is the unsplit loss whatever the split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from milehpc.config.job import JobSpec
    from milehpc.samples.batch import Batch


def mini_batch_count(job: JobSpec) -> int:
    """Optimizer steps per rollout batch (the job rules checked that ``mini_batch_size`` divides the batch)."""
    mbs = job.trainer.mini_batch_size
    return (job.rollout.prompts_per_step * job.rollout.n_samples) // mbs if mbs else 1


def rank_mini_batch_count(job: JobSpec, rows: int, fewest_rows: Callable[[], int] | None) -> int:
    """Optimizer steps this rank takes over its ``rows`` samples: the job's mini-batches, no more than the DP rank
    with the fewest samples has (``fewest_rows``: that count over the DP group; None without DP), so that every rank
    takes the same number of steps."""
    count = mini_batch_count(job)
    if count > 1 and fewest_rows is not None:
        count = min(count, fewest_rows())
    return max(1, min(count, rows))


def split_rows(n: int, parts: int) -> list[range]:
    """``parts`` consecutive row ranges of ``n`` rows, the first ones one longer when uneven (``tensor_split``)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


def mini_batches(batch: Batch, count: int) -> list[Batch]:
    """``batch`` cut into ``count`` consecutive mini-batches (``[batch]`` itself for one: today's step exactly)."""
    if count <= 1:
        return [batch]
    return [batch.select(rows) for rows in split_rows(batch.size, count)]


def token_bins(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices in bins of at most ``budget`` tokens: first fit, longest first (a row over the budget alone);
    each bin's rows in their original order, the bins in the order they were opened (deterministic)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def trim(batch: Batch) -> Batch:
    """The batch cut to its own widths: left prompt columns and right response columns that are padding in every
    row dropped (a bin of short sequences then costs its own length, not the step's longest)."""
    import dataclasses

    import torch

    from milehpc.samples.batch import OPTIONAL_TOKEN_FIELDS

    p = int(batch.prompt_lengths.max())
    r = max(int(batch.response_lengths.max()), 1)
    cut, keep = batch.prompt_width - p, batch.prompt_width + r
    if cut == 0 and keep == batch.input_ids.shape[1]:
        return batch
    changes: dict[str, object] = {name: getattr(batch, name)[:, cut:keep]
                                  for name in ("input_ids", "attention_mask", "position_ids")}
    for name in ("response_mask", "rollout_logprobs", "routed_experts", *OPTIONAL_TOKEN_FIELDS):
        value = getattr(batch, name)
        if isinstance(value, torch.Tensor):
            changes[name] = value[:, :r]
    return dataclasses.replace(batch, prompt_width=p, **changes)


def sequence_lengths(batch: Batch) -> list[int]:
    """Each row's real tokens (prompt + response): what a token budget counts."""
    return batch.attention_mask.sum(-1).tolist()


def micro_batches(batch: Batch, *, size: int, max_tokens: int = 0) -> list[tuple[list[int], Batch]]:
    """(rows of ``batch``, micro-batch) pairs: consecutive ``size`` rows (``Batch.split``, untrimmed: the plain path
    as it always was), or with ``max_tokens`` the token bins, each trimmed."""
    if not max_tokens:
        return [(list(range(s, min(s + size, batch.size))), mb) for s, mb in zip(range(0, batch.size, size),
                                                                                 batch.split(size), strict=True)]
    return [(rows, trim(batch.select(rows))) for rows in token_bins(sequence_lengths(batch), max_tokens)]


def assemble(parts: list[tuple[list[int], torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """The ``[B, R]`` tensor of per-micro-batch ``[b, r]`` results (``r`` <= R, a trimmed micro-batch's width) put
    back at their rows; zeros past each row's width (padding, masked anyway)."""
    import torch

    out = torch.zeros_like(like)
    for rows, part in parts:
        out[torch.as_tensor(rows, device=out.device), : part.shape[1]] = part.to(out.dtype)
    return out
