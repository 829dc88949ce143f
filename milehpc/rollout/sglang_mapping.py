"""Pure functions between milehpc and SGLang: requests, responses, weight-update metadata, engine arguments.

Nothing here imports sglang (or torch at module level), so every mapping is tested on CPU against the signature
facts written down in ``tests/test_sglang_mapping.py``. The facts come from these files of sgl-project/sglang
(checked at commit 001067ff):

* ``python/sglang/srt/entrypoints/engine.py`` — ``Engine.generate(prompt=None, sampling_params=None,
  input_ids=None, ..., return_logprob=False, logprob_start_len=None, ..., return_routed_experts=False,
  routed_experts_start_len=0, stream=False, ..., rid=None, ...)``; ``init_weights_update_group(master_address,
  master_port, rank_offset, world_size, group_name, backend="nccl")``; ``update_weights_from_distributed(names,
  dtypes, shapes, group_name="weight_update_group", flush_cache=True, load_format=None)``;
  ``update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``;
  ``release_memory_occupation(tags=None)`` / ``resume_memory_occupation(tags=None)``; ``flush_cache()``;
  ``get_weights_by_name(name, truncate_size=100)``; non-zero ``node_rank`` engines return right after their
  schedulers are ready when ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0``.
* ``python/sglang/srt/sampling/sampling_params.py`` — ``SamplingParams`` fields (``max_new_tokens``, ``stop``,
  ``stop_token_ids``, ``temperature``, ``top_p``, ``top_k`` (-1 = whole vocabulary), ``min_p``, ``n``,
  ``ignore_eos``, ``skip_special_tokens``, ``spaces_between_special_tokens``, ``no_stop_trim``,
  ``sampling_seed``, ...); stop *strings* need the tokenizer (``skip_tokenizer_init=True`` rejects them).
* ``python/sglang/srt/managers/tokenizer_manager.py`` — each output is ``{"text", "output_ids", "meta_info"}``;
  ``meta_info["output_token_logprobs"]`` is a list of ``(logprob, token_id, text_or_None)``;
  ``meta_info["finish_reason"]`` is the ``to_json()`` of ``FINISH_MATCHED_TOKEN``/``FINISH_MATCHED_STR``
  (``{"type": "stop", "matched": ...}``), ``FINISH_LENGTH`` (``{"type": "length", "length": n}``) or
  ``FINISH_ABORT`` (``{"type": "abort", "message": ...}``) from ``managers/schedule_batch.py``, ``None`` while
  unfinished; ``meta_info["routed_experts"]`` is base64 of a little-endian int32 C-order array of shape
  ``(prompt_len + completion_len - 1, num_layers, topk)`` (one row per token fed to the model; decoded that way by
  THUDM/slime ``slime/rollout/sglang_rollout.py``/``slime/utils/types.py`` for routing replay, R3).
* ``python/sglang/srt/constants.py`` — memory tags ``"weights"``, ``"kv_cache"``, ``"cuda_graph"``.
* THUDM/slime ``slime/backends/sglang_utils/sglang_engine.py`` — dtypes travel as ``str(dtype)`` without the
  ``torch.`` prefix (the scheduler does ``getattr(torch, dtype)``).
* sglang 0.5.23 ``srt/model_executor/model_runner_components/weight_updater.py`` —
  ``update_weights_from_distributed(..., load_format="flattened_bucket")`` receives one uint8 broadcast from rank 0
  per call, laid out by ``FlattenedTensorBucket.empty(names, dtypes, shapes)`` (:func:`flatten_bucket`).
* sglang 0.5.23 image prompts (:func:`processor_output`, :func:`engine_name`): ``Engine.generate(image_data=...)``
  takes per request a list holding one ``{"format": "processor_output", ...}`` dict (``managers/io_struct.py``
  ``_normalize_image_data``; ``multimodal/processors/base_processor.py`` ``_validate_one_modality`` refuses more
  than one per request); ``multimodal/processors/qwen_vl.py`` takes the ids as given when they already hold one
  image token per merged patch, splits the item per image by ``image_grid_thw`` and derives the 3-D positions from
  the image tokens' places; ``models/qwen2_5_vl.py`` names its parameters as the original checkpoints
  (``model.layers.*``, ``visual.*``, ``lm_head.*``) and its ``load_weights`` skips any other name silently.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from milehpc.config.sglang_options import (
    SGLangOptions,
)
from milehpc.data.images import IMAGES_KEY
from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.samples import Sample, Status

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import JobSpec
    from milehpc.config.precision import Precision
    from milehpc.rollout.engine import SamplingParams

# python/sglang/srt/constants.py
TAG_WEIGHTS = "weights"
TAG_KV_CACHE = "kv_cache"
TAG_CUDA_GRAPH = "cuda_graph"
# radixark/miles train.py offloads cuda graphs, KV cache and weights after generation, then brings the weights back
# before the update and the KV cache (+ cuda graphs) after it.
OFFLOAD_TAGS = (TAG_CUDA_GRAPH, TAG_KV_CACHE, TAG_WEIGHTS)
ONLOAD_BEFORE_UPDATE = (TAG_WEIGHTS,)
ONLOAD_AFTER_UPDATE = (TAG_KV_CACHE, TAG_CUDA_GRAPH)

WEIGHT_GROUP_PREFIX = "milehpc_wsync"

_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def check_server_args_known(extra: dict[str, Any], known: Iterable[str], *, file: str | None = None) -> None:
    """Inside the job, where sglang imports: every extra key must be a ``ServerArgs`` field."""
    known = set(known)
    for key in extra:
        if key not in known:
            raise ConfigError("not an SGLang ServerArgs field", file=file, field=f"rollout.options.server_args.{key}")


@dataclass(frozen=True)
class EngineLayout:
    """Where one SGLang engine runs: ``gpus`` MPI ranks, each driving one GPU, as SGLang "nodes"."""

    engine: int
    engine_rank: int  # SGLang node_rank
    gpus_per_engine: int  # SGLang tp_size == nnodes (one GPU per rank)
    dist_init_addr: str | None  # host:port of the engine leader (multi-rank engines only)
    port: int  # the engine's own (unused) HTTP port, unique per engine on a node
    base_gpu_id: int = 0  # this rank's GPU among those its process sees (Plan.device_index)


def server_args(job: JobSpec, opts: SGLangOptions, precision: Precision, layout: EngineLayout, *,
                model_path: str, tokenizer_path: str | None) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine(**kwargs)`` (== ``ServerArgs`` fields)."""
    moe = job.model.num_experts > 0
    # Routing replay of a dense model is refused on the login node (config.rules.routing_replay_needs_moe).
    routed = opts.return_routed_experts if opts.return_routed_experts is not None else moe
    args: dict[str, Any] = {
        "model_path": model_path,
        # Token ids in and out; the tokenizer is only needed for stop *strings* (SamplingParams.normalize).
        "skip_tokenizer_init": not job.rollout.stop,
        "tp_size": layout.gpus_per_engine,
        "random_seed": job.run.seed + layout.engine,
        "port": layout.port,
        "log_level": "error",
        **precision.sglang_server_args(),
    }
    if tokenizer_path:
        args["tokenizer_path"] = tokenizer_path
    # SGLang's scheduler takes GPU ``base_gpu_id + (tp_rank % tp_size_per_node) * gpu_id_step`` (sglang 0.5.23
    # entrypoints/engine.py ``_launch_scheduler_processes``); every milehpc rank is an SGLang "node" of one GPU
    # (tp_size_per_node = 1), so the scheduler's GPU is ``base_gpu_id``: the rank's own GPU as its process sees it
    # (0 under per-task binding, the node-local index under per-node binding: SGLang's default 0 would put every
    # engine of a node, and a colocated engine beside a trainer on another GPU, on GPU 0).
    args["base_gpu_id"] = layout.base_gpu_id
    if layout.gpus_per_engine > 1:
        args.update(nnodes=layout.gpus_per_engine, node_rank=layout.engine_rank,
                    dist_init_addr=layout.dist_init_addr)
    if job.resources.colocate:
        args["enable_memory_saver"] = True
    mem = opts.mem_fraction_static if opts.mem_fraction_static is not None else (0.5 if job.resources.colocate
                                                                                 else None)
    if mem is not None:
        args["mem_fraction_static"] = mem
    if routed:
        args["enable_return_routed_experts"] = True
    if opts.spec is not None:
        args.update(opts.spec.server_args())
        if job.resources.colocate:
            # A colocated engine releases its weights without a copy (the update refills them), but the update
            # carries the target model only: SGLang keeps the draft model's weights across a release only with this
            # (model_runner_components/load_model_utils.py: the draft's weights region gets enable_cpu_backup).
            args["enable_draft_weights_cpu_backup"] = True
    args.update(opts.server_args)
    return args


# ---------------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Request:
    """One SGLang request = one response. ``n`` samples of a prompt are ``n`` requests sharing the prompt, so that
    the order of outputs is ours (no dependence on how SGLang expands ``n``) and partial rollouts continue
    individually; the radix cache still shares the prompt's KV cache between them."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    prompt_ids: list[int]
    group: int
    index: int
    prefix_ids: list[int] = field(default_factory=list)  # response tokens already generated (partial rollout)
    prefix_logprobs: list[float] = field(default_factory=list)
    prefix_loss_mask: list[int] = field(default_factory=list)
    weight_version: int | None = None  # version that generated the prefix's first token
    source: Sample | None = None
    images: list[str] = field(default_factory=list)  # references of the images the prompt shows (in order)


def sampling_params(sp: SamplingParams, *, max_new_tokens: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """milehpc ``SamplingParams`` → one SGLang ``sampling_params`` dict (keys are SGLang ``SamplingParams`` fields)."""
    out: dict[str, Any] = {
        "temperature": float(sp.temperature),
        "top_p": float(sp.top_p),
        "top_k": int(sp.top_k) if sp.top_k > 0 else -1,  # ours: 0 = off; SGLang: -1 = whole vocabulary
        "max_new_tokens": int(sp.max_new_tokens if max_new_tokens is None else max_new_tokens),
        # Keep the stop token in the output (the trainer sees exactly what was sampled) and never touch text.
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in sp.stop_token_ids]
    if seed is not None:
        out["sampling_seed"] = int(seed)
    return out


def build_requests(prompts: Sequence[Sequence[int]], sp: SamplingParams,
                   samples: Sequence[Sample] | None = None, *, first_index: int = 0,
                   seeded: bool = True) -> list[Request]:
    """``sp.n`` requests per prompt (grouped, in prompt order), or one request per unfinished sample to continue.

    ``seeded``: pass per-sample ``sampling_seed`` (SGLang honours it with ``enable_deterministic_inference``, as
    slime uses it); otherwise the engine's ``random_seed`` governs sampling."""
    requests: list[Request] = []
    if not seeded:
        from dataclasses import replace

        sp = replace(sp, seed=None)
    if samples:
        for s in samples:
            left = sp.max_new_tokens - len(s.response_ids)
            if left <= 0:
                continue
            requests.append(Request(
                input_ids=list(s.prompt_ids) + list(s.response_ids),
                sampling_params=sampling_params(sp, max_new_tokens=left,
                                                seed=None if sp.seed is None else sp.seed + s.index),
                prompt_ids=list(s.prompt_ids), group=s.group, index=s.index,
                prefix_ids=list(s.response_ids), prefix_logprobs=list(s.rollout_logprobs),
                prefix_loss_mask=list(s.loss_mask), weight_version=s.weight_version, source=s,
                images=list(s.metadata.get(IMAGES_KEY) or [])))
        return requests
    for g, prompt in enumerate(prompts):
        for k in range(sp.n):
            index = first_index + g * sp.n + k
            requests.append(Request(
                input_ids=list(prompt), prompt_ids=list(prompt), group=g, index=index,
                # Distinct seeds per sample: the same seed for all n would give n identical responses.
                sampling_params=sampling_params(sp, seed=None if sp.seed is None else sp.seed + index),
                images=list(sp.images[g]) if sp.images is not None else []))
    return requests


def generate_kwargs(requests: Sequence[Request], *, return_routed_experts: bool = False,
                    images: Callable[[list[str]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine.generate`` for a batch of requests (token ids in, logprobs out).
    ``images``: a request's image references -> its ``processor_output`` item (:func:`processor_output`); needed
    when a request shows images."""
    kwargs: dict[str, Any] = {
        "input_ids": [r.input_ids for r in requests],
        "sampling_params": [r.sampling_params for r in requests],
        # Logprobs of the generated tokens only (logprob_start_len left at its default); the prompt's are
        # recomputed by the trainer anyway.
        "return_logprob": True,
    }
    if any(r.images for r in requests):
        if images is None:
            raise RuntimeFailure("prompts with images reached an SGLang engine whose model takes none")
        # One list per request (SGLang's list-of-lists form): the request's one processor_output item, or none.
        kwargs["image_data"] = [[images(r.images)] if r.images else [] for r in requests]
    if return_routed_experts:
        kwargs["return_routed_experts"] = True
    return kwargs


def processor_output(shown: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """One request's images (each its patch rows and grid (t, h, w), :func:`milehpc.data.images.pixels`) as SGLang's
    ``processor_output`` image item: the patch rows of all of them back to back and their grids [N, 3], what the HF
    processor returns for the prompt. SGLang splits the rows per image by the grids and places each image at its run
    of image tokens in the request's ids, which milehpc has already widened to one per merged patch."""
    import torch

    return {"format": "processor_output", "pixel_values": torch.cat([p for p, _ in shown]),
            "image_grid_thw": torch.stack([g.reshape(3) for _, g in shown])}


# The names SGLang's model class of a family loads, from transformers 5's (the trainer's): its load_weights drops any
# other name without a word, so an unmapped tensor would simply not arrive (README's VL section).
_ENGINE_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}


def engine_name(name: str, model_type: str | None) -> str:
    """A weight's name in transformers 5's model (what the trainer syncs) -> the name SGLang's class for
    ``model_type`` loads (unchanged for the text families, whose names are the checkpoints')."""
    for old, new in _ENGINE_PREFIXES.get(model_type or "", ()):
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


# ---------------------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------------------
def finish_status(finish_reason: Any) -> Status:
    """SGLang ``meta_info["finish_reason"]`` → Status (``None`` = cut off before finishing = ABORTED)."""
    if finish_reason is None:
        return Status.ABORTED
    kind = finish_reason.get("type") if isinstance(finish_reason, dict) else str(finish_reason)
    if kind not in _FINISH_STATUS:
        raise RuntimeFailure(f"SGLang returned an unknown finish_reason {finish_reason!r}")
    return _FINISH_STATUS[kind]


def decode_routed_experts(data: str, rows: int, num_layers: int, topk: int) -> list[list[list[int]]]:
    """Decode ``meta_info["routed_experts"]`` (base64 int32, C order) into ``rows x num_layers x topk`` ids."""
    import numpy as np

    raw = base64.b64decode(data.encode("ascii"))
    flat = np.frombuffer(raw, dtype="<i4")
    expected = rows * num_layers * topk
    if flat.size != expected:
        raise RuntimeFailure(
            f"SGLang routed_experts has {flat.size} ids, expected {rows} tokens x {num_layers} layers x {topk}")
    return flat.reshape(rows, num_layers, topk).tolist()


def encode_routed_experts(ids: Sequence[Sequence[Sequence[int]]]) -> str:
    """Inverse of :func:`decode_routed_experts` (what SGLang's tokenizer manager does)."""
    import numpy as np

    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode("ascii")


def to_sample(output: dict[str, Any], request: Request, *, weight_version: int,
              moe_shape: tuple[int, int] | None = None) -> Sample:
    """One SGLang output dict → a Sample (token ids and logprobs straight from the engine, never re-tokenised).

    ``moe_shape`` = (num_layers, topk) when routed experts were requested. ``Sample.routed_experts`` holds, per
    response token, the routing of the forward pass that sampled it (token position ``prompt_len - 1 + j``); the
    prompt's rows go to ``metadata["prompt_routed_experts"]`` so the trainer can replay the whole sequence.
    """
    meta = output.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise RuntimeFailure("SGLang output has no meta_info.output_token_logprobs (return_logprob was not set)")
    new_ids = [int(p[1]) for p in pairs]
    new_lps = [float(p[0]) for p in pairs]
    out_ids = output.get("output_ids")
    if out_ids is not None and list(out_ids) != new_ids:
        raise RuntimeFailure("SGLang output_ids and output_token_logprobs disagree on the sampled tokens")
    status = finish_status(meta.get("finish_reason"))
    response = request.prefix_ids + new_ids
    mask = (request.prefix_loss_mask or [1] * len(request.prefix_ids)) + [1] * len(new_ids)
    version = weight_version if request.weight_version is None or not request.prefix_ids else request.weight_version
    sample = Sample(
        prompt_ids=list(request.prompt_ids), response_ids=response, rollout_logprobs=request.prefix_logprobs + new_lps,
        loss_mask=mask, status=status, group=request.group, index=request.index, weight_version=version)
    if request.source is not None:
        src = request.source
        sample.label, sample.prompt_text, sample.metadata = src.label, src.prompt_text, dict(src.metadata)
    elif request.images:  # as the reference engine: a continuation finds the images it shows here
        sample.metadata[IMAGES_KEY] = list(request.images)
    if request.prefix_ids:
        # Which policy versions produced the tokens (partial rollouts span a weight update).
        sample.metadata.setdefault("version_spans", []).append([len(request.prefix_ids), weight_version])
    if moe_shape is not None:
        data = meta.get("routed_experts")
        if data is None:
            raise RuntimeFailure("SGLang returned no routed_experts although they were requested "
                                 "(start the engine with enable_return_routed_experts)")
        total = len(request.input_ids) + len(new_ids) - 1
        rows = decode_routed_experts(data, total, *moe_shape)
        p = len(request.prompt_ids)
        sample.routed_experts = rows[p - 1:]
        sample.metadata["prompt_routed_experts"] = rows[:p - 1]
    return sample


# ---------------------------------------------------------------------------------------------------------------
# Weight updates
# ---------------------------------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (SGLang does ``getattr(torch, name)`` on the receiving side)."""
    return str(dtype).removeprefix("torch.")


def weight_metadata(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """``names`` / ``dtypes`` / ``shapes`` for ``update_weights_from_distributed`` (order = broadcast order)."""
    return {
        "names": [n for n, _ in named],
        "dtypes": [dtype_name(t.dtype) for _, t in named],
        "shapes": [[int(d) for d in t.shape] for _, t in named],
    }


# SGLang's ``load_format`` for one uint8 broadcast per bucket (``update_weights_from_distributed``): the receiver
# allocates ``FlattenedTensorBucket.empty(names, dtypes, shapes)`` (python/sglang/srt/weight_sync/tensor_bucket.py),
# takes one broadcast from rank 0 into it and cuts it back into tensors by byte offsets.
FLATTENED_BUCKET = "flattened_bucket"


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]], out: Callable[[int, Any], torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, dict[str, list]]:
    """One bucket as SGLang's flattened-bucket receiver lays it out: a 1-D uint8 tensor (on the tensors' device)
    holding each tensor's bytes back to back, and the ``names`` / ``dtypes`` / ``shapes`` of the tensors in that
    order (the only metadata the receiver gets; it derives the byte offsets from them).

    The receiver refuses a tensor whose byte offset is not a multiple of its dtype's size (no padding is possible),
    so the tensors go widest dtype first: every size is a multiple of the narrower (power-of-two) sizes after it.
    Costs one copy of a bucket of several tensors (as SGLang's own ``FlattenedTensorBucket``); saves a collective
    per tensor. ``out(nbytes, device)``: a uint8 buffer of ``nbytes`` to copy them into (a sender's reused buffer:
    fresh memory per bucket costs page faults on a CPU); else a new one."""
    import torch

    if not named:
        raise ValueError("cannot flatten an empty bucket")
    ordered = sorted(named, key=lambda nt: -nt[1].element_size())  # stable: same-width tensors keep their order
    views = [t.contiguous().view(-1).view(torch.uint8) for _, t in ordered]
    # A bucket of one (an oversized embedding or lm_head) goes as its own bytes: no second copy of it on the device.
    if len(views) == 1:
        flat = views[0]
    elif out is None:
        flat = torch.cat(views)
    else:
        flat = torch.cat(views, out=out(sum(v.numel() for v in views), views[0].device))
    return flat, weight_metadata(ordered)


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group named tensors into buckets of at most ``bucket_bytes`` (a bigger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def group_name(stage: int, generation: int = 0) -> str:
    """The SGLang weight-update group of one pipeline stage; a rebuilt group (``generation`` > 0: after an engine
    restarted or a sync broke) gets a new name, so nothing of the old group's rendezvous can mix into it."""
    return f"{WEIGHT_GROUP_PREFIX}_pp{stage}" + (f"_g{generation}" if generation else "")


def rank_offset(engine: int, gpus_per_engine: int) -> int:
    """The update group's rank of an engine's TP rank 0 (rank 0 is the trainer's stage leader)."""
    return 1 + engine * gpus_per_engine
