"""Megatron-core checks that need real process groups, run as ONE launch (importing megatron takes seconds):

    mpirun -np 2 python tests/megatron_checks.py OUT.json WORK_DIR [GROUP,...]

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
* ``parity``  — the same batch through the torch trainer and the Megatron trainer (TP=1 x DP=2, TP=2, PP=2) with a
  KL reference (in the loss, in the reward): loss, KL, gradients; the reference offloaded when colocated and
  rebuilt on resume (issue 17 item 1). Any world size: at one rank only TP=1 x DP=1.
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


def _full_weights(comm: Any, trainer: Any, *, grads: bool = False) -> dict[str, Any]:
    """The trainer's export (a collective; of the last step's gradients with ``grads``), as seen by every rank."""
    w = dict(trainer.export_weights(grads=grads))
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


PARITY_ALGORITHMS = {
    # KL in the loss (k3 = low_var_kl, verl's GRPO default) and KL in the reward (k1 on the rollout logprobs).
    "kl_loss": {"advantage": "grpo", "kl_coef": 0.5, "kl_type": "low_var_kl"},
    "kl_reward": {"advantage": "grpo", "kl_coef": 0.5, "kl_type": "k1", "kl_in_reward": True},
}


def _parity_job(algorithm: dict[str, Any], *, colocate: bool = False, **trainer: Any) -> Any:
    """No clipping and no weight decay (Megatron exempts norms and biases from decay; the torch AdamW does not)."""
    from milehpc.config.load import job_from_dict

    model = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48}
    ranks = trainer.get("tp", 1) * trainer.get("pp", 1) * trainer.get("dp", 1)
    rollout = {"temperature": 0.8, "engines": ranks if colocate else 1}  # colocated: an engine on every rank
    return job_from_dict({"name": "parity", "model": model, "rollout": rollout, "algorithm": algorithm,
                          "resources": {"colocate": colocate},
                          "trainer": {"backend": "megatron", "micro_batch_size": 2, "lr": 1e-2, "clip_grad": 0.0,
                                      **trainer}})


def _parity_samples() -> list[Any]:
    """Two GRPO groups of 3 (one per DP rank at DP=2) with engine logprobs (what KL in the reward reads)."""
    samples = _samples(13)
    for s in samples:
        s.rollout_logprobs = [-1.0 - 0.25 * j for j in range(len(s.response_ids))]
    return samples


def _second_step(trainer: Any, samples: list[Any], grads: Any) -> dict[str, Any]:
    """Two steps (the second one's policy differs from the reference: the KL term and its gradient are not 0);
    the second step's loss, KL and gradient norm, and its gradients in HF names."""
    trainer.freeze_reference()  # what the loop does when RL begins
    trainer.train_step(samples, 0)
    m = trainer.train_step(samples, 1)
    kl = m.get("train/actor/kl_loss", m.get("train/reward/kl_penalty"))
    return {"loss": m["train/loss"], "kl": kl, "grad_norm": m["train/grad_norm"], "grads": grads()}


def check_parity(comm: Any, work: str) -> dict[str, Any]:
    """The same batch through the torch trainer (one rank's, on every rank) and the Megatron trainer at TP=1 x DP=2
    (each DP rank one group), TP=2 and PP=2, with the KL reference on (issue 17 item 1)."""
    import types
    from unittest import mock

    from milehpc.train import torch_trainer
    from milehpc.train.megatron.trainer import MegatronTrainer

    samples = _parity_samples()
    out: dict[str, Any] = {}
    for name, algorithm in PARITY_ALGORITHMS.items():
        # The torch trainer as on a single rank (no DDP over this 2-rank world): the reference numbers.
        with mock.patch.object(torch_trainer, "_dist", return_value=(0, 1)):
            tt = torch_trainer.TorchTrainer(_parity_job(algorithm), types.SimpleNamespace(pad_id=0, eos_id=2,
                                                                                          vocab_size=V), options={})
            seen: dict[str, Any] = {}
            step = tt.optimizer.step

            def capture(*args: Any, _step: Any = step, _seen: dict = seen, _tt: Any = tt, **kwargs: Any) -> Any:
                _seen.update({n: p.grad.detach().clone() for n, p in _tt.module.named_parameters()})
                return _step(*args, **kwargs)

            tt.optimizer.step = capture
            want = _second_step(tt, samples, lambda seen=seen: dict(seen))
        got = {"torch_kl": want["kl"], "torch_grad_norm": want["grad_norm"],
               "grads_max": max(float(g.abs().max()) for g in want["grads"].values())}
        world = comm.Get_size()
        # TP=1 x DP=world, TP=world, PP=world (at one rank: TP=1 x DP=1 alone).
        for layout, (tp, pp) in ({"tp1": (1, 1), f"tp{world}": (world, 1), f"pp{world}": (1, world)}
                                 if world > 1 else {"tp1": (1, 1)}).items():
            dp = world // (tp * pp)
            # Colocated (TP=world): the reference waits in CPU memory between uses (its moves are recorded).
            tr = MegatronTrainer(_parity_job(algorithm, tp=tp, pp=pp, dp=dp, colocate=layout == f"tp{world}"),
                                 pad_id=0, vocab_size=V)
            moves: list[str] = []

            def move(device: Any, _to: Any = tr.ref.to, _moves: list[str] = moves) -> Any:
                _moves.append(str(device))
                return _to(device)

            tr.ref.to = move
            mine = [s for s in samples if s.group % dp == tr.dp_rank]  # whole GRPO groups per DP rank
            # Gradients in HF names from the first stage's leader: all of them without PP.
            run = _second_step(tr, mine, lambda tr=tr: _full_weights(comm, tr, grads=True))
            got[f"{layout}_loss_diff"] = abs(run["loss"] - want["loss"])
            got[f"{layout}_kl_diff"] = abs(run["kl"] - want["kl"])
            got[f"{layout}_grad_norm_rel"] = abs(run["grad_norm"] / want["grad_norm"] - 1)
            if pp == 1:
                got[f"{layout}_grads_maxdiff"] = _maxdiff(run["grads"], want["grads"])
            got[f"{layout}_ref_moves"] = list(moves)
            got[f"{layout}_ref_trainable"] = sum(p.requires_grad for p in tr.ref.parameters())
            if name == "kl_loss" and layout == f"tp{world}":  # before the next layout re-carves the groups
                got.update(_resume_with_reference(comm, tr, mine, work))
        out[name] = got
    return out


def _resume_with_reference(comm: Any, tr: Any, samples: list[Any], work: str) -> dict[str, Any]:
    """The reference is not checkpointed: a resumed trainer rebuilds it from the initial weights, and its next
    step equals the uninterrupted one's (loss, KL and weights)."""
    from milehpc.train.megatron import checkpoint
    from milehpc.train.megatron.trainer import MegatronTrainer

    path = f"{work}/dist-ckpt-kl"
    checkpoint.save(tr, path)
    want = tr.train_step(samples, 2)
    after = _full_weights(comm, tr)
    again = MegatronTrainer(tr.job, pad_id=0, vocab_size=V)
    checkpoint.load(again, path)
    again.freeze_reference()  # what a resumed loop does (it skips the warm-up)
    got = again.train_step(samples, 2)
    return {"resume_loss_diff": abs(got["train/loss"] - want["train/loss"]),
            "resume_kl_diff": abs(got["train/actor/kl_loss"] - want["train/actor/kl_loss"]),
            "resume_kl": want["train/actor/kl_loss"],
            "resume_weights_maxdiff": _maxdiff(after, _full_weights(comm, again))}


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
    groups = {"logits": lambda: check_logits(comm), "path": lambda: check_from_path(comm, work),
              "ckpt": lambda: check_ckpt(comm, work), "replay": lambda: check_replay(comm),
              "devices": lambda: check_devices(comm), "parity": lambda: check_parity(comm, work)}
    # An optional third argument runs only the named groups (comma-separated), e.g. while working on one.
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(groups)
    for name in only:
        results[name] = groups[name]()
    if comm.Get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
