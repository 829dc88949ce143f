"""``[rollout.options]`` of the ``sglang`` engine: the option tables (speculative decoding included), the server
args milehpc derives itself, and their validation. Pure (no sglang, no torch): the login node validates a job with it
(the engine plugin's ``check_options``) and the engine factory parses the options with it inside the job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from milehpc.config.schema import build, opt
from milehpc.config.tested_versions import TESTED_GPU_PACKAGES
from milehpc.errors import ConfigError


@dataclass
class SpeculativeOptions:
    """``[rollout.options.speculative]``: SGLang speculative decoding (``--speculative-*`` server args)."""

    algorithm: Literal["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"] = opt("EAGLE")
    draft_model_path: str | None = opt(None, help="local folder of the draft model (EAGLE head / small model)")
    num_steps: int = opt(3, min=1, help="draft steps per verify")
    eagle_topk: int = opt(1, min=1, max=32, help="branching factor of the draft tree per step")
    num_draft_tokens: int = opt(4, min=2, help="tokens verified per step (tree size)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.algorithm != "NEXTN" and not self.draft_model_path:
            # NEXTN drafts with the model's own MTP layers; the others need a draft checkpoint.
            raise ConfigError(f"missing (speculative algorithm {self.algorithm} needs a draft model folder)",
                              file=file, field=f"{prefix}.draft_model_path")
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            # SGLang silently rewrites it to num_steps + 1 for a chain; say so instead of running something else.
            raise ConfigError(
                f"with eagle_topk = 1 the draft is a chain: expected num_draft_tokens = num_steps + 1 = "
                f"{self.num_steps + 1}, got {self.num_draft_tokens}", file=file, field=f"{prefix}.num_draft_tokens")
        most = self.num_steps * self.eagle_topk + 1
        if self.num_draft_tokens > most:
            raise ConfigError(
                f"expected at most num_steps * eagle_topk + 1 = {most} draft tokens, got {self.num_draft_tokens}",
                file=file, field=f"{prefix}.num_draft_tokens")

    def server_args(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "speculative_algorithm": self.algorithm,
            "speculative_num_steps": self.num_steps,
            "speculative_eagle_topk": self.eagle_topk,
            "speculative_num_draft_tokens": self.num_draft_tokens,
        }
        if self.draft_model_path:
            out["speculative_draft_model_path"] = self.draft_model_path
        return out


@dataclass
class SGLangOptions:
    """``[rollout.options]`` when ``rollout.engine = "sglang"``."""

    speculative: dict[str, Any] = opt({}, help="speculative decoding (EAGLE draft model); empty = off")
    server_args: dict[str, Any] = opt({}, help="extra SGLang ServerArgs (checked against ServerArgs at start)")
    mem_fraction_static: float | None = opt(None, min=0.05, max=0.95,
                                            help="GPU share for weights+KV cache; unset = 0.5 colocated, else SGLang's")
    return_routed_experts: bool | None = opt(None, help="routing replay (R3); unset = on for MoE models")
    weight_bucket_mb: int = opt(512, min=1, help="bucket size of the weight update")
    check_weights_truncate: int = opt(100, min=1, help="elements per tensor read back by named_parameters()")
    health_timeout_s: float = opt(60.0, min=1.0)
    max_restarts: int = opt(3, min=0, help="in-place restarts of a dead engine before the job fails")
    cpu_memory_gib: float = opt(2.0, min=0.01, help="a CPU engine's memory (weights + KV pool, of which "
                                "mem_fraction_static), instead of the host's free memory")
    # Built from ``speculative`` by parse_options (a table of its own, validated with its own field names).
    spec: SpeculativeOptions | None = field(default=None, init=False)


# Server args milehpc derives from the job spec; setting them in rollout.options.server_args would fork the truth.
RESERVED_SERVER_ARGS = {
    "model_path": "model.path", "tokenizer_path": "model.tokenizer", "tp_size": "rollout.gpus_per_engine",
    "nnodes": "rollout.gpus_per_engine", "node_rank": "the rank layout", "dist_init_addr": "the rank layout",
    "base_gpu_id": "the rank layout", "gpu_id_step": "the rank layout",
    "enable_draft_weights_cpu_backup": "resources.colocate with rollout.options.speculative",
    "dtype": "trainer.precision", "quantization": "trainer.precision",
    "enable_memory_saver": "resources.colocate", "enable_return_routed_experts": "rollout.options.return_routed_experts",
    "random_seed": "run.seed", "skip_tokenizer_init": "rollout.stop",
    "speculative_algorithm": "rollout.options.speculative", "speculative_draft_model_path": "rollout.options.speculative",
    "speculative_num_steps": "rollout.options.speculative", "speculative_eagle_topk": "rollout.options.speculative",
    "speculative_num_draft_tokens": "rollout.options.speculative",
    "mem_fraction_static": "rollout.options.mem_fraction_static",
}


def parse_options(options: dict[str, Any], *, file: str | None = None) -> SGLangOptions:
    """Validate ``rollout.options`` for the sglang engine (one-line ConfigError naming the field)."""
    opts = build(SGLangOptions, options, file=file, prefix="rollout.options")
    if opts.speculative:
        opts.spec = build(SpeculativeOptions, opts.speculative, file=file, prefix="rollout.options.speculative")
    for key in opts.server_args:
        if key in RESERVED_SERVER_ARGS:
            raise ConfigError(f"set by milehpc from {RESERVED_SERVER_ARGS[key]}; change that instead",
                              file=file, field=f"rollout.options.server_args.{key}")
    return opts



def rl_quantization_args(args: dict[str, Any], *, random_init: bool) -> dict[str, Any]:
    """The RL-correct loader for a quantized rollout: SGLang quantizes once at load, so bf16 weights pushed by every
    sync into a plain ``quantization="fp8"`` engine do not become the served fp8 weights. sglang 0.5.23's reload path
    is ``load_format="flash_rl"`` (``QuantizedRLModelLoader`` in ``model_loader/loader.py``: it records the native
    loaders at the first load and re-quantizes each update into the existing fp8 buffers). It is fp8 only and needs a
    real first load, so anything else is refused with one line."""
    quant = args.get("quantization")
    if not quant:
        return args
    if quant != "fp8":
        raise ConfigError(f"SGLang can reload weights into a quantized engine only for fp8 (load_format='flash_rl'); "
                          f"{quant!r} rollout is not supported", field="trainer.fp8_recipe")
    if random_init:
        raise ConfigError("fp8 rollout needs a checkpoint folder: SGLang's flash_rl loader records the weight loaders "
                          "at the first real load (load_format='dummy' has none)", field="model.path")
    if args.get("load_format") not in (None, "auto", "flash_rl"):
        raise ConfigError(f"fp8 rollout reloads weights with load_format='flash_rl', not {args['load_format']!r}",
                          field="rollout.options.server_args.load_format")
    return {**args, "load_format": "flash_rl"}


def server_arg_names(server_args_cls: Any) -> set[str]:
    """Field names of SGLang's ``ServerArgs``: a ``msgspec.Struct`` in sglang 0.5.23 (``__struct_fields__``), a
    dataclass in older releases."""
    fields = getattr(server_args_cls, "__struct_fields__", None)
    if fields is not None:
        return set(fields)
    import dataclasses

    return {f.name for f in dataclasses.fields(server_args_cls)}


def check_against_server_args(args: dict[str, Any], *, extra: dict[str, Any] | None = None,
                              server_args_cls: Any = None) -> None:
    """Inside the job (sglang imports): every argument milehpc passes must be a real ``ServerArgs`` field, and the
    loader / speculative choices must be ones this sglang knows (one ConfigError line naming the field)."""
    if server_args_cls is None:
        from sglang.srt.server_args import ServerArgs as server_args_cls
    known = server_arg_names(server_args_cls)
    for key in extra or {}:
        if key not in known:
            raise ConfigError("not an SGLang ServerArgs field", field=f"rollout.options.server_args.{key}")
    for key in args:
        if key != "custom_sigquit_handler" and key not in known:
            raise ConfigError(f"this sglang has no ServerArgs field {key!r} (milehpc was tested with sglang "
                              f"{TESTED_SGLANG})", field="rollout.engine")
    choices = _sglang_choices()
    if args.get("load_format") and choices.get("load_format") and args["load_format"] not in choices["load_format"]:
        raise ConfigError(f"this sglang has no load_format {args['load_format']!r}", field="rollout.options")
    algo = args.get("speculative_algorithm")
    if algo:
        try:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            SpeculativeAlgorithm.from_string(algo)
        except ImportError:
            pass
        except (ValueError, KeyError) as err:
            raise ConfigError(f"SGLang does not know speculative algorithm {algo!r}: {err}",
                              field="rollout.options.speculative.algorithm") from err


TESTED_SGLANG = TESTED_GPU_PACKAGES["sglang"]  # the version the contract tests ran against (the gpu extra pins it)


def _sglang_choices() -> dict[str, list[str]]:
    try:
        from sglang.srt.arg_groups import choices
    except ImportError:
        return {}
    return {"load_format": list(getattr(choices, "LOAD_FORMAT_CHOICES", []) or [])}
