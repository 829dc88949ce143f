"""Megatron-core checks that need real process groups, run as ONE launch (importing megatron takes seconds):

    mpirun -np 2 python tests/megatron_checks.py OUT.json WORK_DIR

Rank 0 writes the measured figures to OUT.json; tests/test_megatron_mpi.py asserts on them. Groups (each re-carves
Megatron's parallel state out of the same 2-rank world):

* ``logits``  — TP=2: the Megatron model built from HF weights vs the HF model: logits (gathered over TP),
  per-token logprobs and entropy from the vocab-parallel path; the export at TP=2 round-trips the HF weights.
* ``path``    — the model from a local HF checkpoint folder (``model.path``).
* ``ckpt``    — dist_checkpointing with the distributed optimizer: save at TP=2, resume at TP=2 (bit-exact next
  step) and at TP=1 x DP=2 (resharded).
* ``replay``  — MoE (Qwen2-MoE: 4 experts, top-2, shared expert), EP=2: routing recorded by an HF "engine" one
  weight version behind; expert choices in the trainer with and without routing replay, counted.
* ``devices`` — the device check (``MILEHPC_DEVICE_CHECK=nccl``, set by the test for the whole launch: every
  group above ran under it): it is on, it catches a CPU tensor on an NCCL-standing group, and the trainers'
  float reductions (Megatron ``_dp_sum``, torch ``_all_reduce``) pass it (issue 12, fault 8).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

V = 37  # odd: TP=2 pads the vocabulary to 38, so the padded-column masking is exercised


def length_reward(sample: Any) -> float:
    """A reward that varies within every group from the first step (the loop test's "module:function" reward),
    so GRPO has advantages to learn from before the policy can solve anything."""
    return len(sample.response_ids) / 8.0


def _job(**trainer: Any) -> Any:
    from milehpc.config.load import job_from_dict

    model = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48}
    model.update(trainer.pop("model", {}))
    opts = trainer.pop("options", {})
    return job_from_dict({"name": "mg", "model": model,
                          "trainer": {"backend": "megatron", "micro_batch_size": 2, "lr": 1e-2, "options": opts,
                                      **trainer}})


def _samples(seed: int, n: int = 6) -> list[Any]:
    import torch

    from milehpc.samples import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, V, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, V, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(prompt_ids=p, response_ids=r, reward=float(i % 2), group=i // 3, index=i))
    return out


def _full_weights(comm: Any, trainer: Any) -> dict[str, Any]:
    """The trainer's export (a collective), as seen by every rank."""
    w = dict(trainer.export_weights())
    return comm.bcast(w if comm.Get_rank() == 0 else None, root=0)


def _maxdiff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def check_logits(comm: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from milehpc.models import build_model
    from milehpc.train.megatron.model import attention_mask
    from milehpc.train.megatron.trainer import MegatronTrainer, vocab_parallel_logprobs

    out: dict[str, Any] = {}
    for arch in ("qwen2", "llama"):
        job = _job(tp=2, model={"arch": arch})
        hf = build_model(job.model, V, seed=3).eval()
        tr = MegatronTrainer(job, pad_id=0, vocab_size=V, hf_model=build_model(job.model, V, seed=3))
        export = _full_weights(comm, tr)
        out[f"{arch}_export_vs_hf"] = _maxdiff(export, dict(hf.state_dict()))
        ids = torch.randint(3, V, (3, 10), generator=torch.Generator().manual_seed(1))
        valid = torch.ones(3, 10, dtype=torch.long)
        valid[0, :4] = 0  # left padding, as to_batch makes it
        valid[2, 8:] = 0  # right padding
        pos = (valid.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            dev = tr.device  # under the device check the model's inputs must go where its weights are
            shard = tr.module(ids.to(dev), pos.to(dev), attention_mask(valid.to(dev)))  # [B, T, V/tp]
            parts = [torch.empty_like(shard) for _ in range(2)]
            dist.all_gather(parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, -1)[..., :V].cpu()
            ref = hf(input_ids=ids, attention_mask=valid, position_ids=pos).logits
            targets = ids.roll(-1, 1)
            logp, ent = (t.cpu() for t in vocab_parallel_logprobs(shard, targets.to(dev), V, entropy=True))
            shard = shard.cpu()
            ref_lp = torch.log_softmax(ref, -1)
            ref_logp = ref_lp.gather(-1, targets[..., None])[..., 0]
            ref_ent = -(ref_lp.exp() * ref_lp).sum(-1)
        m = valid.bool()
        out[f"{arch}_logits_maxdiff"] = float((logits - ref)[m].abs().max())
        out[f"{arch}_logprob_maxdiff"] = float((logp - ref_logp)[m].abs().max())
        out[f"{arch}_entropy_maxdiff"] = float((ent - ref_ent)[m].abs().max())
        out[f"{arch}_padded_vocab"] = int(shard.shape[-1] * 2)
    return out


def check_from_path(comm: Any, work: str) -> dict[str, Any]:
    """model.path: the trainer reads the HF checkpoint folder (config + weights) instead of the [model] table."""
    from milehpc.models import build_model
    from milehpc.train.megatron.trainer import MegatronTrainer

    folder = f"{work}/hf-llama"
    hf = build_model(_job(model={"arch": "llama"}).model, V, seed=11)
    if comm.Get_rank() == 0:
        hf.save_pretrained(folder)
    comm.Barrier()
    job = _job(tp=2, model={"path": folder, "hidden_size": 8, "num_layers": 1})  # the table is ignored
    tr = MegatronTrainer(job, pad_id=0, vocab_size=V)
    return {"path_layers": tr.arch.num_layers, "path_export_vs_hf": _maxdiff(_full_weights(comm, tr),
                                                                             dict(hf.state_dict()))}


def check_ckpt(comm: Any, work: str) -> dict[str, Any]:
    from milehpc.train.megatron import checkpoint
    from milehpc.train.megatron.trainer import MegatronTrainer

    samples = _samples(5)
    path = f"{work}/dist-ckpt"
    tr = MegatronTrainer(_job(tp=2, distributed_optimizer=True), pad_id=0, vocab_size=V)
    for step in range(2):
        tr.train_step(samples, step)
    checkpoint.save(tr, path)
    saved = _full_weights(comm, tr)
    tr.train_step(samples, 2)
    after = _full_weights(comm, tr)  # the uninterrupted run's next step

    same = MegatronTrainer(_job(tp=2, distributed_optimizer=True), pad_id=0, vocab_size=V)
    checkpoint.load(same, path)
    out = {"tp2_reload_vs_saved": _maxdiff(saved, _full_weights(comm, same)), "tp2_version": same.version}
    same.train_step(samples, 2)
    out["tp2_resume_step_vs_uninterrupted"] = _maxdiff(after, _full_weights(comm, same))

    other = MegatronTrainer(_job(tp=1, dp=2, distributed_optimizer=True), pad_id=0, vocab_size=V)
    checkpoint.load(other, path)
    out["tp1dp2_reload_vs_saved"] = _maxdiff(saved, _full_weights(comm, other))
    other.train_step(samples, 2)
    out["tp1dp2_resume_step_vs_uninterrupted"] = _maxdiff(after, _full_weights(comm, other))
    return out


def check_replay(comm: Any) -> dict[str, Any]:
    import torch

    from milehpc.models import build_model
    from milehpc.train.megatron.trainer import MegatronTrainer

    job = _job(tp=1, ep=2, dp=2, lr=5e-2, micro_batch_size=4, options={"routing_replay": True},
               model={"num_experts": 4, "moe_top_k": 2, "intermediate_size": 32})
    tr = MegatronTrainer(job, pad_id=0, vocab_size=V)
    engine = build_model(job.model, V, seed=0).eval()
    engine.load_state_dict(_full_weights(comm, tr), strict=True)  # the export gathers the experts over EP
    samples = _samples(7, n=8)
    # The engine's routing, one per input position (prompt + response[:-1]), recorded at its MoE gates.
    seen: list[Any] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
             for layer in engine.model.layers]
    for s in samples:
        seen.clear()
        with torch.no_grad():
            engine(torch.tensor([s.prompt_ids + s.response_ids[:-1]]))
        s.routed_experts = torch.stack(seen, 1).tolist()
    for h in hooks:
        h.remove()
    tr.train_step(samples, 0)  # the trainer moves one version ahead of the engine that routed these

    used: list[tuple[int, Any]] = []
    layers = tr.module.decoder.layers
    for i, layer in enumerate(layers):
        layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: used.append((i, out[1].detach().clone())))

    def count(replay: bool) -> tuple[int, int]:
        tr.replay = replay
        used.clear()
        tr.compute_logprobs(samples)
        batch = tr._batch(samples)
        t, mbs = batch.input_ids.shape[1], job.trainer.micro_batch_size
        same = total = 0
        for n, (li, routing_map) in enumerate(used):
            first = (n // len(layers)) * mbs
            size = min(mbs, len(samples) - first)
            routing_map = routing_map.view(t, size, -1)
            for b in range(size):
                s = samples[first + b]
                start = batch.prompt_width - len(s.prompt_ids)
                for j, experts in enumerate(s.routed_experts):
                    chosen = set(torch.nonzero(routing_map[start + j, b]).flatten().tolist())
                    total += 1
                    same += chosen == set(experts[li])
        return same, total

    free_same, free_total = count(False)
    replay_same, replay_total = count(True)
    tr.train_step(samples, 1)  # and training with replay runs
    return {"replay_identical": replay_same, "replay_total": replay_total, "free_identical": free_same,
            "free_total": free_total}


def check_devices(comm: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from milehpc.comm import devcheck
    from milehpc.train import torch_trainer
    from milehpc.train.megatron.trainer import MegatronTrainer

    out: dict[str, Any] = {"enabled": devcheck.enabled(), "simulating": devcheck.simulating(),
                           "violations_before": devcheck.violations()}
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.float64))  # what fault 8 did: a CPU tensor on an NCCL group
        out["cpu_tensor_caught"] = False
    except devcheck.DevicePlacementError as err:
        out["cpu_tensor_caught"] = "all_reduce" in str(err) and "cpu tensor" in str(err)
    out["torch_all_reduce"] = torch_trainer._all_reduce([1.0, float(comm.Get_rank())])
    out["torch_all_reduce_max"] = torch_trainer._all_reduce([float(comm.Get_rank())], "max")
    tr = MegatronTrainer(_job(tp=1, dp=2), pad_id=0, vocab_size=V)
    out["megatron_dp_sum"] = tr._dp_sum([1.0, float(comm.Get_rank())])
    out["megatron_dp_max"] = tr._dp_sum([float(comm.Get_rank())], "max")
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from mpi4py import MPI

    out_path, work = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    results: dict[str, Any] = {"world_size": dist.get_world_size()}
    from milehpc.train.megatron import cpu_adapt

    cpu_adapt.apply()  # turns the device check on (MILEHPC_DEVICE_CHECK) before any group is used
    results["logits"] = check_logits(comm)
    results["path"] = check_from_path(comm, work)
    results["ckpt"] = check_ckpt(comm, work)
    results["replay"] = check_replay(comm)
    results["devices"] = check_devices(comm)
    if comm.Get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
