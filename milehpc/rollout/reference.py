"""The reference rollout engine: batched sampling on an HF-architecture model with a KV cache, in plain
PyTorch. It is the CPU/embedded default and also runs on a GPU.

Logprobs are those of the distribution sampled from before top-k/top-p truncation, i.e.
``log_softmax(logits / temperature)`` (temperature 0 = greedy, scored at temperature 1), computed in fp32. The
trainer divides its logits by the same temperature, so with fp32 weights the two agree to float rounding.

Generation (``python bench/engine_speed.py`` times it against transformers' ``generate``): each distinct context
is prefilled once and its KV-cache rows are copied to the samples that continue it (a prompt's ``n`` samples);
every step draws a token for every row from the engine's random stream, finished rows included (their token is
dropped), so a row's samples never depend on when the others finish; once a quarter of the decode batch has
finished, those rows leave it (and the cache); no forward runs after the last token.

LoRA (``[trainer.lora]``): a sync carries adapter tensors named ``<module>.lora_A.weight`` / ``.lora_B.weight``
(:mod:`milehpc.train.lora`) and the scaling ``alpha / rank`` as a one-element tensor named :data:`LORA_SCALING`
(so the engine needs no job config to apply them). The engine keeps a copy of the base weight of each adapted
module and sets the module's weight to ``base + (B @ A) * scaling``, the very expression (and rounding) of peft's
own merge, so a new adapter replaces the old one exactly instead of piling up on it.

Multi-LoRA (``[trainer.lora.adapters]``): each adapter arrives under its name (``<module>.lora_A.<NAME>.weight``,
``lora.scaling.<NAME>``, a module trained in full ``<module>.modules_to_save.<NAME>.weight``); the engine keeps the
base once plus every adapter and generates each prompt with its adapter (``SamplingParams.adapters``), one adapter
at a time, merged into the adapted weights from the kept base by the same expression (a module trained in full: its
copy replaces the base's): exact, whichever adapter was merged before. An adapter not synced yet generates with the
base (a fresh adapter is B = 0, a module to save starts as the base's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from milehpc.data.images import IMAGES_KEY
from milehpc.errors import RuntimeFailure
from milehpc.rollout.engine import SamplingParams, by_adapter
from milehpc.samples import Sample, Status

if TYPE_CHECKING:
    import torch

    from milehpc.comm.context import RunContext
    from milehpc.config.job import JobSpec


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k and outside the top-p nucleus with -inf (the first token always stays)."""
    import torch

    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p.
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


LORA_SCALING = "lora.scaling"  # the adapter's alpha / rank, sent with it


class ReferenceEngine:
    """Implements :class:`milehpc.rollout.engine.Engine` for any HF causal LM held in this process."""

    def __init__(self, model: Any, tokenizer: Any, *, device: Any = "cpu", seed: int = 0, version: int = 0) -> None:
        import torch

        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.eos_id, self.pad_id = int(tokenizer.eos_id), int(tokenizer.pad_id)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.version = version
        self.tokens_generated = 0
        self.adapter: dict[str, torch.Tensor] = {}  # the last synced adapter tensors (engine names)
        self._lora_base: dict[str, torch.Tensor] = {}  # weight name -> the base weight under its adapter
        self._adapted: dict[str, set[str]] = {}  # multi-LoRA: adapter name -> the weights it changes
        self._active: str | None = None  # multi-LoRA: the adapter merged now (None: none, or a stale merge)
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns); 4.x knows only the old.
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # The prefill needs the last position's logits only (what transformers' own generate asks for).
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    # ---- generation ---------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        """``sampling.n`` samples per prompt (prompt-major order; ``group`` = prompt position), or, with
        ``samples``, continue each given sample by up to ``sampling.max_new_tokens`` more tokens. Multi-LoRA
        (``sampling.adapters``): each adapter's prompts in turn with that adapter merged, its samples after the
        previous adapter's."""
        if sampling.adapters is not None:
            if samples is not None:
                raise RuntimeFailure("continuing partial rollouts per adapter is not supported")
            out: list[Sample] = []
            for name, where in by_adapter(sampling.adapters).items():
                self.use_adapter(name)
                shown = None if sampling.images is None else [sampling.images[i] for i in where]
                part = self.generate([prompts[i] for i in where], replace(sampling, adapters=None, images=shown))
                for s in part:
                    s.group = where[s.group]
                out += part
            return out
        images: list[list[str]] | None = None
        if samples is not None:
            contexts = [s.prompt_ids + s.response_ids for s in samples]
            out = samples
            if any(s.metadata.get(IMAGES_KEY) for s in samples):
                images = [list(s.metadata.get(IMAGES_KEY) or []) for s in samples]
        else:
            out = [Sample(prompt_ids=list(p), group=g, weight_version=self.version)
                   for g, p in enumerate(prompts) for _ in range(sampling.n)]
            contexts = [s.prompt_ids for s in out]
            if sampling.images is not None and any(sampling.images):
                images = [list(sampling.images[s.group]) for s in out]
                for s, refs in zip(out, images, strict=True):
                    s.metadata[IMAGES_KEY] = refs
        if not out:
            return out
        new_ids, new_lps, stopped = self._decode(contexts, sampling, images)
        for s, ids, lps, stop in zip(out, new_ids, new_lps, stopped, strict=True):
            s.response_ids = s.response_ids + ids
            s.rollout_logprobs = s.rollout_logprobs + lps
            s.loss_mask = s.loss_mask + [1] * len(ids)
            s.status = Status.COMPLETED if stop else Status.TRUNCATED
            s.response_text = self.tokenizer.decode(s.response_ids)
            s.metadata.setdefault("versions", []).append(self.version)
        return out

    def _decode(self, contexts: list[list[int]], sp: SamplingParams, images: list[list[str]] | None = None,
                ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        import torch
        from transformers.cache_utils import DynamicCache

        B, T = len(contexts), sp.max_new_tokens
        # Prefill each distinct context once (a prompt's n samples share it) and copy its cache rows to the samples
        # that continue it: the prefill is most of a short generation's work, and a row's result is the same.
        # With images a context is its tokens and the images it shows.
        keys = [tuple(c) for c in contexts] if images is None else [
            (tuple(c), tuple(refs)) for c, refs in zip(contexts, images, strict=True)]
        distinct: dict[tuple[Any, ...], int] = {}
        rows = torch.tensor([distinct.setdefault(k, len(distinct)) for k in keys], device=self.device)
        ids, mask = _left_padded(list(distinct) if images is None else [k[0] for k in distinct], self.pad_id)
        L = ids.shape[1]
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        vision: dict[str, Any] = {}
        if images is not None:  # pixels and 3-D positions (milehpc.models_vl): [3, rows, L]
            from milehpc.data.images import rows_pixels, tokenizer_folder
            from milehpc.models_vl import vision_inputs

            shown = rows_pixels(tokenizer_folder(self.tokenizer), [list(k[1]) for k in distinct])
            vision = vision_inputs(self.model, ids, mask, shown)
            pos = vision.pop("position_ids")
        # One mask for the whole generation (the prompt's padding, then ones); step k passes its first L + k columns.
        full_mask = torch.ones((B, L + T), dtype=mask.dtype, device=self.device)
        full_mask[:, :L] = mask.index_select(0, rows)
        # The rows are the second-last dimension of positions ([B, 1], or [3, B, 1] with images).
        next_pos = pos[..., -1:].index_select(-2, rows) + 1
        stop_ids = torch.tensor(sorted({self.eos_id, *sp.stop_token_ids}), device=self.device)
        temperature = sp.temperature if sp.temperature > 0 else 1.0
        gen = self.generator
        if sp.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sp.seed)

        out_ids = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        out_lps = torch.zeros((B, T), dtype=torch.float32, device=self.device)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        stopped = torch.zeros(B, dtype=torch.bool, device=self.device)
        pad = torch.full((B,), self.pad_id, dtype=torch.long, device=self.device)
        cache = DynamicCache()
        with torch.inference_mode():
            logits = self.model(input_ids=None if vision else ids, attention_mask=mask, position_ids=pos,
                                use_cache=True, **{self._cache_kw: cache}, **self._last_logits,
                                **vision).logits[:, -1, :]
            if len(distinct) < B:
                logits = logits.index_select(0, rows)
                cache.reorder_cache(rows)
            scores = logits.float() / temperature
            live = None  # the rows in the decode batch: None = all; else their indices (finished rows leave it)
            for k in range(T):
                # All B rows are drawn, finished ones too (their token becomes pad): the random stream advances as
                # it always did, so a row's draw does not depend on which other rows have finished.
                tok = torch.where(done, pad, _draw(scores, sp, gen))
                out_ids[:, k] = tok
                out_lps[:, k] = torch.log_softmax(scores, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
                lengths += ~done
                hit = torch.isin(tok, stop_ids) & ~done
                if sp.stop:
                    hit |= self._stop_strings(out_ids, lengths, done, sp.stop)
                stopped |= hit
                done |= hit
                if k + 1 == T:  # the last token needs no forward after it
                    break
                left = int((~done).sum())
                if left == 0:
                    break
                if left <= (B if live is None else len(live)) * 3 // 4:
                    # A quarter of the batch has finished: drop those rows from the cache (a copy of it, about
                    # what a step's cache growth costs anyway) instead of computing them every step.
                    keep = (~done if live is None else ~done[live]).nonzero().squeeze(1)
                    live = keep if live is None else live[keep]
                    cache.reorder_cache(keep)
                sel = slice(None) if live is None else live
                step = self.model(input_ids=tok[sel, None], attention_mask=full_mask[sel, :L + k + 1],
                                  position_ids=next_pos[..., sel, :] + k, use_cache=True,
                                  **{self._cache_kw: cache}).logits[:, -1, :].float() / temperature
                if live is None:
                    scores = step
                else:
                    scores[live] = step
        lengths_l = lengths.tolist()
        ids_l, lps_l = out_ids.tolist(), out_lps.tolist()
        self.tokens_generated += sum(lengths_l)
        return ([r[:n] for r, n in zip(ids_l, lengths_l, strict=True)],
                [r[:n] for r, n in zip(lps_l, lengths_l, strict=True)], stopped.tolist())

    def _stop_strings(self, out_ids: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor,
                      stop: list[str]) -> torch.Tensor:
        import torch

        hit = torch.zeros_like(done)
        for i in (~done).nonzero().flatten().tolist():
            text = self.tokenizer.decode(out_ids[i, : int(lengths[i])].tolist())
            hit[i] = any(text.endswith(s) for s in stop)
        return hit

    # ---- weights ------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        import torch

        state = self.model.state_dict()
        merge: set[str] = set()
        receive_into = getattr(named_tensors, "receive_into", None)
        if receive_into is not None:  # a weight-sync stream: the bytes land in the parameters themselves (issue 33)
            receive_into(lambda name, dtype, shape: self._in_place_target(name, state))
        with torch.no_grad():
            for name, tensor in named_tensors:
                weight = _adapted_weight(name)
                if weight is None and (named := _named_adapter(name)) is not None:
                    self._receive_named(name, named, tensor, state)
                    continue
                if name == LORA_SCALING or weight is not None:
                    if weight is not None and weight not in state:
                        raise KeyError(f"the engine's model has no parameter {weight!r} for the adapter {name!r}")
                    self.adapter[name] = tensor.detach().clone()  # the stream's buffers are reused
                    # the scaling alone changing re-merges every adapted weight
                    merge.update([weight] if weight is not None else self._lora_base)
                    continue
                if name not in state:
                    raise KeyError(f"the engine's model has no parameter named {name!r}")
                if name in self._lora_base:  # a new base under an adapter: merged again below
                    self._lora_base[name].copy_(tensor)
                    merge.add(name)
                elif not _same_memory(state[name], tensor):  # (received in place: nothing to copy)
                    state[name].copy_(tensor)
            if self._adapted:  # multi-LoRA: the next generation merges its adapter afresh
                self._active = None
            else:
                for weight in sorted(merge):
                    self._merge(weight, state[weight])
        self.version = version

    def _in_place_target(self, name: str, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The parameter a sync may receive ``name`` straight into: a plain weight (not an adapter's, not a base an
        adapter is merged into, which keeps its own copy)."""
        if name in self._lora_base or _adapted_weight(name) is not None or _named_adapter(name) is not None:
            return None
        return state.get(name)

    def _receive_named(self, name: str, named: tuple[str, str | None], tensor: torch.Tensor,
                       state: dict[str, torch.Tensor]) -> None:
        """Keep one tensor of a named adapter (multi-LoRA); merged when a generation asks for that adapter."""
        adapter, weight = named
        if weight is not None:
            if weight not in state:
                raise KeyError(f"the engine's model has no parameter {weight!r} for the adapter {name!r}")
            self._adapted.setdefault(adapter, set()).add(weight)
        self.adapter[name] = tensor.detach().clone()

    def use_adapter(self, adapter: str | None) -> None:
        """Merge ``adapter`` (multi-LoRA) into the adapted weights, from the kept base; the base alone while it was
        never synced (or for None)."""
        if adapter is not None and adapter == self._active:  # (None: the base, also after a stale merge)
            return
        import torch

        state = self.model.state_dict()
        weights = self._adapted.get(adapter)
        with torch.no_grad():
            for weight, base in self._lora_base.items():  # another adapter's delta off every weight
                if weights is None or weight not in weights:
                    state[weight].copy_(base)
            for weight in sorted(weights or ()):
                full = self.adapter.get(f"{weight.removesuffix('.weight')}.modules_to_save.{adapter}.weight")
                if full is None:
                    self._merge(weight, state[weight], adapter)
                else:  # trained in full by this adapter: its own copy
                    self._lora_base.setdefault(weight, state[weight].detach().clone())
                    state[weight].copy_(full)
        self._active = adapter

    def _merge(self, weight: str, target: torch.Tensor, adapter: str | None = None) -> None:
        """``target = base + (B @ A) * scaling`` (peft's ``get_delta_weight`` and merge, bit for bit) with the one
        adapter, or with the named ``adapter`` of a multi-LoRA job."""
        module = weight.removesuffix(".weight")
        mid = "" if adapter is None else f".{adapter}"
        a, b = self.adapter.get(f"{module}.lora_A{mid}.weight"), self.adapter.get(f"{module}.lora_B{mid}.weight")
        if a is None or b is None:
            raise KeyError(f"adapter of {module!r} incomplete: a sync must carry both lora_A and lora_B")
        scaling = self.adapter.get(LORA_SCALING + mid)
        if scaling is None:
            raise KeyError(f"adapter of {module!r} arrived without {LORA_SCALING!r}")
        base = self._lora_base.setdefault(weight, target.detach().clone())
        delta = (b.to(base.device) @ a.to(base.device)) * float(scaling)
        target.copy_(base + delta.to(base.dtype))

    def weight_version(self) -> int:
        return self.version

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The model's weights and, with LoRA, the adapter it holds (what the weight check compares)."""
        return [*self.model.state_dict().items(), *self.adapter.items()]

    # ---- lifecycle ----------------------------------------------------------
    def health(self) -> bool:
        return True

    def restart(self) -> None:
        """In-process: nothing to restart."""

    def release_memory(self) -> None:
        """CPU: weights stay put (the caches are freed after every generate)."""

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """CPU: nothing was released."""

    def shutdown(self) -> None:
        self.model = None

    def info(self) -> dict[str, Any]:
        return {"name": "reference", "device": str(self.device), "version": self.version,
                "tokens_generated": self.tokens_generated}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.version = int(state["version"])


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is ``a``'s own storage (a sync received it in place), not a tensor to copy from."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


def _adapted_weight(name: str) -> str | None:
    """``m.lora_A.weight`` / ``m.lora_B.weight`` -> ``m.weight``, the weight the adapter changes; else None."""
    for part in (".lora_A.weight", ".lora_B.weight"):
        if name.endswith(part):
            return name.removesuffix(part) + ".weight"
    return None


def _named_adapter(name: str) -> tuple[str, str | None] | None:
    """A multi-LoRA tensor name -> (adapter, the weight it changes; None for its scaling); else None:
    ``m.lora_A.NAME.weight`` (or ``m.modules_to_save.NAME.weight``) -> (NAME, ``m.weight``), ``lora.scaling.NAME``
    -> (NAME, None)."""
    if name.startswith(LORA_SCALING + "."):
        return name.removeprefix(LORA_SCALING + "."), None
    if name.endswith(".weight"):
        head, _, adapter = name.removesuffix(".weight").rpartition(".")
        for part in (".lora_A", ".lora_B", ".modules_to_save"):
            if head.endswith(part):
                return adapter, head.removesuffix(part) + ".weight"
    return None


def _draw(scores: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``scores`` (logits / temperature): greedy at temperature 0, else sampled after
    top-k/top-p."""
    import torch

    if sp.temperature == 0:
        return scores.argmax(-1)
    probs = torch.softmax(filter_logits(scores, sp.top_k, sp.top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _left_padded(contexts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``contexts``, left-padded so every row's next token takes the same column."""
    import torch

    L = max(map(len, contexts))
    ids = torch.tensor([(pad_id,) * (L - len(c)) + c for c in contexts], dtype=torch.long)
    mask = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in contexts], dtype=torch.long)
    return ids, mask


def sampling_from_spec(rollout: Any, tokenizer: Any) -> SamplingParams:
    """The job's ``[rollout]`` sampling settings."""
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                          max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop), n=rollout.n_samples)


def build_engine(job: JobSpec, *, device: Any = "cpu", rank: int = 0) -> ReferenceEngine:
    """The job's model (same seeded init as the trainer) on ``device``, sampling from a stream seeded per rank.
    ``rollout.options`` were checked on the login node (:mod:`milehpc.config.rules`)."""
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model

    tok = build_tokenizer(job.model.tokenizer)
    model = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    return ReferenceEngine(model, tok, device=device, seed=job.run.seed * 100_003 + rank)


def from_context(ctx: RunContext) -> ReferenceEngine:
    """Engine factory (``impl(ctx)``): :func:`build_engine` on this rank's device."""
    return build_engine(ctx.job, device=ctx.comms.device or "cpu", rank=ctx.comms.rank)
