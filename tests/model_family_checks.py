"""The Megatron trainer on every supported family, in ONE process (a gloo world of one rank; importing megatron
takes seconds, so one launch covers them all):

    python tests/model_family_checks.py OUT.json WORK_DIR [family,...]

Per family the Megatron trainer takes (tests/family_models.py): a tiny random HF folder -> ``MegatronTrainer`` with ``model.path`` = that
folder -> its logprobs vs transformers', its export (HF names) vs the folder's weights, two RL steps, and the
trained export written as an HF folder (milehpc.export.folder) that ``AutoModelForCausalLM`` reloads with the
trainer's logprobs. tests/test_model_families.py asserts on the JSON.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

from family_models import FAMILY_CONFIGS, save_tiny
from megatron_checks import V, _job, _samples
from megatron_single_checks import _hf_logprobs


def _maxdiff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def check_family(kind: str, work: Path) -> dict[str, Any]:
    import torch
    import transformers

    from milehpc.export.folder import hf_model, write_model
    from milehpc.train.megatron.trainer import MegatronTrainer

    folder = work / f"hf-{kind}"
    hf = save_tiny(kind, folder, V, seed=7)
    samples = _samples(13, n=6)
    job = _job(model={"path": str(folder)})  # the [model] table's shape is ignored: the folder's config.json rules
    tr = MegatronTrainer(job, pad_id=0, vocab_size=V)
    want = dict(hf.state_dict())
    if hf.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    export = dict(tr.export_weights())
    out: dict[str, Any] = {
        "model_type": tr.arch.model_type,
        "qk_norm": tr.config.qk_layernorm,
        "vs_hf_logprobs": _maxdiff(tr.compute_logprobs(samples), _hf_logprobs(hf, samples)),
        "export_names_equal": sorted(export) == sorted(want),
        "export_vs_hf": max(float((export[k] - want[k]).abs().max()) for k in want) if export.keys() == want.keys()
        else -1.0,
    }
    steps = [tr.train_step(samples, step) for step in range(2)]
    out["grad_norms"] = [m["train/grad_norm"] for m in steps]
    trained = dict(tr.export_weights())
    out["weights_moved"] = max(float((trained[k] - want[k]).abs().max()) for k in want)
    hf_out = work / f"export-{kind}"
    write_model(hf_model(hf.config, trained), hf_out, dtype=None, generation=transformers.GenerationConfig())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
    with torch.no_grad():
        out["export_reload_vs_trainer_logprobs"] = _maxdiff(_hf_logprobs(reloaded, samples),
                                                            tr.compute_logprobs(samples))
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    import socket

    import torch.distributed as dist

    out_path, work = sys.argv[1], Path(sys.argv[2])
    from milehpc.config.families import FAMILIES

    kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else [k for k in FAMILY_CONFIGS if FAMILIES[k].megatron]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    results: dict[str, Any] = {}
    for kind in kinds:
        try:
            results[kind] = check_family(kind, work)
        except Exception as err:  # each family reports on its own: one failure does not hide the others
            import traceback

            results[kind] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    Path(out_path).write_text(json.dumps(results, indent=1), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
