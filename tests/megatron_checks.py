"""Megatron-core checks that need real process groups, run as ONE launch (importing megatron takes seconds):

    mpirun -np 4 python tests/megatron_checks.py OUT.json WORK_DIR [GROUP,...]

Rank 0 writes the measured figures to OUT.json; tests/test_megatron_mpi.py asserts on them. The 4-rank group runs
first on the whole world; then ranks 0-1 carry on in a fresh 2-rank process group (ranks 2-3 are done) for the
others, each of which re-carves Megatron's parallel state out of the same 2-rank world (``-np 2`` runs those alone):

* ``colocated`` (4 ranks) — the RL loop colocated (milehpc's bootstrap, loop and reference engines), Megatron at
  TP=2 x DP=2: each engine's weights after each load against the trainer's export of that version (issue 30).
* ``parity4`` (4 ranks) — the same batch through the torch trainer and the Megatron trainer at TP=2 x PP=2 with the
  KL reference, the critic (PPO/GAE) and the teacher (distillation), and every other estimator, loss and
  aggregation mode (``PARITY_MODES``): loss, value loss, gradient norms.
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
* ``batching`` — issue 33: mini-batches (TP=2) against the torch trainer's and one mini-batch against the plain step;
  token-budget micro-batches (PP=2); full and selective recomputation and sequence parallelism (TP=2) against plain
  TP=2 (:func:`check_batching`).
* ``parity``  — the same batch through the torch trainer and the Megatron trainer (TP=1 x DP=2, TP=2, PP=2) with a
  KL reference (in the loss, in the reward), a critic (GAE) and a teacher (distillation): loss, KL, value loss,
  policy and critic gradients; the reference and teacher offloaded when colocated, the reference rebuilt on resume,
  the critic resumed bit-exactly from the dist checkpoint and resharded TP=2 -> PP=2 (issue 17 item 1); and every
  other estimator, loss and aggregation mode (``PARITY_MODES``) at TP=1 x DP=2 only: step loss and gradients. Any
  world size: at one rank only TP=1 x DP=1.
"""

from __future__ import annotations

import json
import math
import sys
import time
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


def _lazy_export(tr: Any) -> list[int]:
    """Issue 33: the export gathers one parameter at a time as it is iterated (the sync sends each before the next
    is gathered): [TP gathers made when the stage leader had its first tensor, TP gathers in all]."""
    gathers = [0]
    real = tr._gather

    def counted(t: Any, group: Any) -> Any:
        gathers[0] += 1
        return real(t, group)

    tr._gather = counted
    try:
        it = iter(tr.export_weights())
        first = next(it, None)  # the leader's first tensor; the other rank drains the whole export here
        at_first = gathers[0] if first is not None else -1
        for _ in it:
            pass
    finally:
        del tr._gather
    return [at_first, gathers[0]]


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
        if arch == "qwen2":
            out["export_gathers"] = _lazy_export(tr)
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


def token_reward(sample: Any) -> float:
    """A reward that differs between the samples of a group from the first step (the responses of a random model all
    run to max_new_tokens, so their lengths do not), so every step moves the weights."""
    return (sum(sample.response_ids) % 7) / 7.0


COLOCATED_JOB = {
    "name": "megatron-colocated",
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 32},  # tests/tiny_model.py
    "data": {"source": "task:reverse", "params": {"min_len": 1, "max_len": 4}},
    "reward": {"name": "megatron_checks:token_reward"},
    "rollout": {"engines": 4, "prompts_per_step": 4, "n_samples": 2, "max_new_tokens": 4, "temperature": 0.8},
    "trainer": {"backend": "megatron", "tp": 2, "dp": 2, "micro_batch_size": 4, "lr": 1e-2},
    "resources": {"colocate": True, "collective_timeout_s": 120},
    "run": {"steps": 2, "loop": "sync", "check_logprobs": True},
}


def check_colocated_loop(comm: Any, work: str) -> dict[str, Any]:
    """Issue 30 fault 4: the RL loop, colocated, Megatron at TP=2 x DP=2 on the 4 ranks (milehpc's own bootstrap and
    loop; an engine on every rank). Megatron exports the whole model on tp0/dp0 alone, yet every rank's engine must
    load all of it at every sync. Each engine's weights right after each of its loads and the trainer's export at that
    version (rank 0's: PP=1, the whole model) are recorded by wrapping the two methods (the real ones run) and
    compared on rank 0."""
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from milehpc.comm.context import RunContext
    from milehpc.comm.world import bootstrap
    from milehpc.config.load import job_from_dict
    from milehpc.config.site import Launcher, Partition
    from milehpc.plan import make_plan
    from milehpc.rollout.reference import ReferenceEngine
    from milehpc.runtime.loop import run
    from milehpc.train.megatron.trainer import MegatronTrainer

    ps.destroy_model_parallel()
    dist.destroy_process_group()  # the loop brings up its own groups
    job = job_from_dict(COLOCATED_JOB)
    plan = make_plan(job, Partition(scheduler="local", launcher=Launcher(kind="mpirun"), cpus_per_node=4),
                     site="local", partition_name="local")
    run_dir = Path(work) / "colocated"
    run_dir.mkdir(exist_ok=True)
    exports: dict[int, dict[str, Any]] = {}  # trainer version -> what this rank's trainer exported
    loads: list[tuple[int, list[str], dict[str, Any]]] = []  # (version, names received, engine weights after)
    real_export, real_update = MegatronTrainer.export_weights, ReferenceEngine.update_weights

    def export_weights(self: Any, **kwargs: Any) -> Any:
        out = list(real_export(self, **kwargs))  # a lazy export (issue 33): listed to be both kept and handed on
        if not kwargs:
            exports[self.version] = {n: t.detach().cpu().clone() for n, t in out}
        return out

    def update_weights(self: Any, named_tensors: Any, version: int) -> None:
        names: list[str] = []

        def seen() -> Any:
            for name, tensor in named_tensors:
                names.append(name)
                yield name, tensor

        real_update(self, seen(), version)
        state = self.model.state_dict()
        loads.append((version, names, {n: state[n].detach().cpu().clone() for n in names}))

    MegatronTrainer.export_weights, ReferenceEngine.update_weights = export_weights, update_weights
    start = time.perf_counter()
    try:
        comms = bootstrap(plan, job, run_id="megatron-colocated", master_addr="127.0.0.1", world=comm)
        history = run(RunContext(job=job, plan=plan, comms=comms, run_dir=run_dir), progress=False)
        comms.close()
    finally:
        MegatronTrainer.export_weights, ReferenceEngine.update_weights = real_export, real_update
        ps.destroy_model_parallel()
    every = comm.gather(loads, root=0)
    _init_torch_distributed(comm)  # the world group the callers expect back
    if comm.Get_rank() != 0:
        return {}
    out: dict[str, Any] = {"versions": [[v for v, _, _ in mine] for mine in every], "missing": [], "maxdiff": 0.0,
                           "tensors": len(exports[0]), "steps": [r["step"] for r in history],
                           "logprob_diff_max": max(r["train/logprob_diff_max"] for r in history),
                           "trained": _maxdiff(exports[0], exports[max(exports)]),
                           "seconds": time.perf_counter() - start}
    for rank, mine in enumerate(every):
        for version, names, weights in mine:
            want = exports[version]
            out["missing"] += [f"rank {rank} v{version}: {n}" for n in sorted(set(want) - set(names))]
            got = _maxdiff({n: want[n] for n in weights}, weights) if weights else math.inf
            out["maxdiff"] = max(out["maxdiff"], got)
    return out


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
    # PPO with GAE: the critic (values before the update, clipped value loss, its own optimizer step).
    "gae": {"advantage": "gae", "gamma": 0.99, "lam": 0.9},
    # On-policy distillation: the teacher (another architecture, from a local HF folder) against the engine's
    # logprobs of the student.
    "distill": {"advantage": "distill"},
}
# Every other estimator, loss and aggregation mode at least once, in as few configurations as cover them (issue 17
# item 1); run at TP=1 x DP=2 (each DP rank one group: the whitening and the global counts cross ranks) and at
# TP=2 x PP=2 only, to keep the launch short.
PARITY_MODES = {
    # GSPO aggregates its term seq-mean-token-mean whatever the mode; the entropy bonus uses the mode as set.
    "rloo": {"advantage": "rloo", "loss": "gspo", "loss_agg_mode": "seq-mean-token-mean", "entropy_coef": 0.05},
    # Discounted returns (gamma < 1) whitened over the whole batch, across the DP ranks; no normaliser. With the
    # ratio at 1 the whitened advantages sum to 0 and so does the policy term: the KL (k2, in the loss, as the
    # README's REINFORCE++ recipe) makes the step's loss tell.
    "reinforce_pp": {"advantage": "reinforce_pp", "gamma": 0.9, "loss": "policy_gradient",
                     "loss_agg_mode": "token-sum", "kl_coef": 0.5, "kl_type": "mse"},
    # Dr. GRPO with DAPO's clip-higher and soft overlong penalty (from 2 of the 16 new tokens on: every sample) and
    # token-level TIS; two epochs, so the ratio moves off 1 (the clip is live) and the trainer recomputes the old
    # logprobs before the update.
    "dr_grpo": {"advantage": "dr_grpo", "loss": "ppo_clip", "loss_params": {"clip_low": 0.2, "clip_high": 0.28},
                "loss_agg_mode": "seq-mean-token-sum-norm", "overlong_buffer": 14, "off_policy_correction": "tis",
                "ppo_epochs": 2},
    # REINFORCE++-baseline with the entropy bonus and MIS (tokens under the lower bound rejected).
    "reinforce_pp_baseline": {"advantage": "reinforce_pp_baseline", "loss_agg_mode": "seq-mean-token-sum",
                              "entropy_coef": 0.05, "off_policy_correction": "mis", "off_policy_lower": 0.15},
    "sft": {"advantage": "none", "loss": "sft"},
}
CRITIC_LR = 1e-2  # as large as the policy's: the second step's critic differs visibly from the first's


def _algorithm(name: str) -> dict[str, Any]:
    return PARITY_ALGORITHMS.get(name) or PARITY_MODES[name]


def _parity_job(algorithm: dict[str, Any], *, colocate: bool = False, options: dict[str, Any] | None = None,
                model_path: str | None = None, **trainer: Any) -> Any:
    """No clipping and no weight decay (Megatron exempts norms and biases from decay; the torch AdamW does not).
    ``adam_eps`` well above the gradients' fp32 noise (~1e-7 of the largest, 0.2): with the default 1e-8, Adam's first
    update of a parameter whose true gradient is ~0 is +-lr whichever sign the rounding gave it, and the two trainers'
    second-step gradients then differed by up to 4e-5 of the largest (the CPU's reduction order decided); with 1e-4 a
    gradient below it moves its parameter by lr * g / 1e-4, continuous in g."""
    from milehpc.config.load import job_from_dict

    model: dict[str, Any] = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                             "intermediate_size": 48}
    if model_path:
        model["path"] = model_path
    ranks = trainer.get("tp", 1) * trainer.get("pp", 1) * trainer.get("dp", 1)
    rollout = {"temperature": 0.8, "engines": ranks if colocate else 1}  # colocated: an engine on every rank
    return job_from_dict({"name": "parity", "model": model, "rollout": rollout, "algorithm": algorithm,
                          "resources": {"colocate": colocate},
                          "trainer": {"backend": "megatron", "micro_batch_size": 2, "lr": 1e-2, "clip_grad": 0.0, "adam_eps": 1e-4,
                                      "options": options or {}, **trainer}})


def _parity_samples() -> list[Any]:
    """Two GRPO groups of 3 (one per DP rank at DP=2) with engine logprobs (what KL in the reward and the
    distillation read)."""
    samples = _samples(13)
    for s in samples:
        s.rollout_logprobs = [-1.0 - 0.25 * j for j in range(len(s.response_ids))]
    return samples


def _teacher_folder(comm: Any, work: str) -> str:
    """A teacher unlike the student: Llama with 4 layers (the student: Qwen2, 2 layers), other weights."""
    from pathlib import Path

    from milehpc.models import build_model

    folder = f"{work}/hf-teacher"
    if comm.Get_rank() == 0 and not Path(folder).is_dir():
        build_model(_job(model={"arch": "llama", "num_layers": 4}).model, V, seed=21).save_pretrained(folder)
    comm.Barrier()
    return folder


def _family_folder(comm: Any, work: str) -> str:
    """A Qwen3 (per-head q/k RMSNorm, replicated over TP) with Llama 3.x RoPE scaling (tests/family_models.py):
    both families' twists in the one TP=2 x PP=2 case."""
    from pathlib import Path

    from family_models import LLAMA3_ROPE, save_tiny

    folder = f"{work}/hf-qwen3-llama3"
    if comm.Get_rank() == 0 and not Path(folder).is_dir():
        save_tiny("qwen3", folder, V, seed=23, rope_parameters=LLAMA3_ROPE)
    comm.Barrier()
    return folder


def _options(name: str, teacher: str) -> dict[str, Any]:
    return {"critic_lr": CRITIC_LR, **({"teacher_path": teacher} if name == "distill" else {})}


def _second_step(trainer: Any, samples: list[Any], grads: Any, critic_grads: Any) -> dict[str, Any]:
    """Two steps (the second one's policy differs from the reference, and its critic from the first one's: the KL
    term, the value clipping and their gradients are live); the second step's figures and gradients."""
    trainer.freeze_reference()  # what the loop does when RL begins
    trainer.train_step(samples, 0)
    losses = _record_losses(trainer.algorithm)
    m = trainer.train_step(samples, 1)
    kl = m.get("train/actor/kl_loss", m.get("train/reward/kl_penalty"))
    last_epoch = losses[len(losses) - len(losses) // trainer.job.algorithm.ppo_epochs:]
    return {"loss": m["train/loss"], "kl": kl, "grad_norm": m["train/grad_norm"], "grads": grads(),
            "value_loss": m.get("train/critic/value_loss"), "critic_grad_norm": m.get("critic/grad_norm"),
            "critic_grads": critic_grads() if trainer.critic is not None else None,
            "step_loss": sum(last_epoch), "metrics": {k: v for k, v in m.items() if k.startswith("train/")}}


def _record_losses(algorithm: Any) -> list[float]:
    """The policy losses the trainer backpropagates, one per micro-batch call (in the order of the calls).

    Their sum over the micro-batches of one epoch and over the DP ranks, divided by the DP size, is the step's
    loss on the whole batch whatever the split: each is normalised by the step's global counts (see
    milehpc.algorithms.aggregation). The policy's loss alone, checked beside the reported ``train/loss`` (which
    adds the same shares, and for a critic the value term)."""
    calls: list[float] = []
    loss = algorithm.loss

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = loss(*args, **kwargs)
        calls.append(float(out[0].detach()))
        return out

    algorithm.loss = recorded
    return calls


_TORCH: dict[str, dict[str, Any]] = {}  # the torch trainer's figures per algorithm (every launch phase reuses them)


def _torch_reference(comm: Any, name: str, teacher: str, model_path: str | None = None) -> dict[str, Any]:
    """The torch trainer as on a single rank (no DDP over the MPI world): the reference numbers, computed on rank 0
    (the others would only compete for the CPUs) and broadcast."""
    key = f"{name}@{model_path}" if model_path else name
    if key not in _TORCH:
        _TORCH[key] = comm.bcast(_torch_run(name, teacher, model_path) if comm.Get_rank() == 0 else None, root=0)
    return _TORCH[key]


def _torch_run(name: str, teacher: str, model_path: str | None = None) -> dict[str, Any]:
    import types
    from unittest import mock

    from milehpc.train import torch_trainer

    with mock.patch.object(torch_trainer, "_dist", return_value=(0, 1)):
        tt = torch_trainer.TorchTrainer(_parity_job(_algorithm(name), model_path=model_path), types.SimpleNamespace(
            pad_id=0, eos_id=2, vocab_size=V), options=_options(name, teacher))
        seen: dict[str, dict[str, Any]] = {"policy": {}, "critic": {}}

        def capture(opt: Any, module: Any, into: dict[str, Any]) -> None:
            step = opt.step

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                into.update({n: p.grad.detach().clone() for n, p in module.named_parameters()})
                return step(*args, **kwargs)

            opt.step = wrapped

        capture(tt.optimizer, tt.module, seen["policy"])
        if tt.critic is not None:
            capture(tt.critic_opt, tt.critic_module, seen["critic"])
        return _second_step(tt, _parity_samples(), lambda: dict(seen["policy"]), lambda: dict(seen["critic"]))


def _stage_exports(comm: Any, export: Any) -> dict[str, Any]:
    """A collective export (policy or critic), every PP stage's leader's part merged, as seen by every rank."""
    merged: dict[str, Any] = {}
    for part in comm.allgather(dict(export())):
        merged.update(part)
    return merged


def _parity_layout(comm: Any, name: str, want: dict[str, Any], samples: list[Any], teacher: str, *, tp: int,
                   pp: int, colocate: bool, model_path: str | None = None, offload_frozen: bool = False
                   ) -> tuple[Any, dict[str, Any]]:
    """The Megatron trainer at one layout through the same two steps; its figures against the torch trainer's."""
    from milehpc.train.megatron.trainer import MegatronTrainer

    dp = comm.Get_size() // (tp * pp)
    options = {**_options(name, teacher), **({"offload_frozen": True} if offload_frozen else {})}
    tr = MegatronTrainer(_parity_job(_algorithm(name), tp=tp, pp=pp, dp=dp, colocate=colocate,
                                     options=options, model_path=model_path), pad_id=0,
                         vocab_size=V)
    frozen = tr.ref if tr.ref is not None else tr.teacher
    moves: list[str] = []
    if frozen is not None:
        def move(device: Any, _to: Any = frozen.to) -> Any:
            moves.append(str(device))
            return _to(device)

        frozen.to = move
    mine = [s for s in samples if s.group % dp == tr.dp_rank]  # whole GRPO groups per DP rank
    run = _second_step(tr, mine, lambda: _stage_exports(comm, lambda: tr.export_weights(grads=True)),
                       lambda: _stage_exports(comm, lambda: tr.critic.export(grads=True)))
    got: dict[str, Any] = {"layout": [tr.tp, tr.pp, tr.dp_size], "loss_diff": abs(run["loss"] - want["loss"]),
                           "grad_norm_rel": abs(run["grad_norm"] / want["grad_norm"] - 1),
                           "frozen_moves": list(moves),  # those of the two steps
                           "frozen_trainable": sum(p.requires_grad for p in frozen.parameters()) if frozen else 0}
    if want["kl"] is not None:
        got["kl_diff"] = abs(run["kl"] - want["kl"])
    got["grads_maxdiff"] = _maxdiff(run["grads"], want["grads"])  # every stage's, merged
    # The step's loss on the whole batch: every DP rank's last stage's share (once per TP group), over DP.
    shares = comm.allgather(run["step_loss"] if tr.tp_rank == 0 else 0.0)
    got["step_loss_diff"] = abs(sum(shares) / tr.dp_size - want["step_loss"])
    if want["critic_grads"] is not None:
        got["value_loss_diff"] = abs(run["value_loss"] - want["value_loss"])
        got["critic_grad_norm_rel"] = abs(run["critic_grad_norm"] / want["critic_grad_norm"] - 1)
        got["critic_grads_maxdiff"] = _maxdiff(run["critic_grads"], want["critic_grads"])
    return tr, got


def check_parity(comm: Any, work: str) -> dict[str, Any]:
    """The same batch through the torch trainer (one rank's, on every rank) and the Megatron trainer at TP=1 x DP=2
    (each DP rank one group), TP=2 and PP=2, with the KL reference, the critic and the teacher (issue 17 item 1)."""
    samples = _parity_samples()
    teacher = _teacher_folder(comm, work)
    world = comm.Get_size()
    out: dict[str, Any] = {}
    for name in PARITY_ALGORITHMS:
        want = _torch_reference(comm, name, teacher)
        got: dict[str, Any] = {"torch_grad_norm": want["grad_norm"], **_scales(want)}
        # TP=1 x DP=world, TP=world, PP=world (at one rank: TP=1 x DP=1 alone).
        for layout, (tp, pp) in ({"tp1": (1, 1), f"tp{world}": (world, 1), f"pp{world}": (1, world)}
                                 if world > 1 else {"tp1": (1, 1)}).items():
            # Colocated (TP=world): the frozen model waits in CPU memory between uses (its moves are recorded).
            tr, figures = _parity_layout(comm, name, want, samples, teacher, tp=tp, pp=pp,
                                         colocate=layout == f"tp{world}",
                                         # not colocated, asked to offload: the teacher waits in CPU memory too
                                         offload_frozen=name == "distill" and layout == f"pp{world}")
            got.update({f"{layout}_{k}": v for k, v in figures.items()})
            mine = [s for s in samples if s.group % tr.dp_size == tr.dp_rank]
            # Before the next layout re-carves the groups:
            if name == "kl_loss" and layout == f"tp{world}":
                got.update(_resume_with_reference(comm, tr, mine, work))
            if name == "gae" and layout == f"tp{world}":
                got.update(_resume_with_critic(comm, tr, mine, work))
            if name == "gae" and layout == f"pp{world}":
                got.update(_reshard_critic(comm, tr, work))
        out[name] = got
    for name in PARITY_MODES:  # TP=1 x DP=world only (TP=2 x PP=2: check_parity_tp2pp2)
        want = _torch_reference(comm, name, teacher)
        _, figures = _parity_layout(comm, name, want, samples, teacher, tp=1, pp=1, colocate=False)
        out[name] = {"torch_grad_norm": want["grad_norm"], **_scales(want), **_live(want),
                     **{f"tp1_{k}": v for k, v in figures.items()}}
    return out


def _live(want: dict[str, Any]) -> dict[str, Any]:
    """The torch trainer's figures that show a mode's term is at work (so a parity cannot hold vacuously)."""
    m = want["metrics"]
    return {"torch_step_loss": want["step_loss"], "torch_entropy": m.get("train/actor/entropy"),
            "torch_clip_frac": m.get("train/actor/clip_frac"),
            "torch_off_policy_weight_mean": m.get("train/off_policy/weight_mean"),
            "torch_off_policy_rejected": m.get("train/off_policy/capped_fraction"),
            "torch_advantages_abs_mean": m.get("train/advantages/abs_mean")}


def check_parity_tp2pp2(comm: Any, work: str) -> dict[str, Any]:
    """On 4 ranks: the Megatron trainer at TP=2 x PP=2 against the torch trainer, with the KL reference, the critic
    and the teacher: the same loss (and value loss, gradient norms)."""
    samples = _parity_samples()
    teacher = _teacher_folder(comm, work)
    out: dict[str, Any] = {}
    for name in ("kl_loss", "gae", "distill", *PARITY_MODES):
        want = _torch_reference(comm, name, teacher)
        _, out[name] = _parity_layout(comm, name, want, samples, teacher, tp=2, pp=2, colocate=False)
        out[name].update(_scales(want))
    # Model families (tests/test_model_families.py): Qwen3's q/k norms and Llama 3.x RoPE scaling, split 2 x 2.
    family = _family_folder(comm, work)
    want = _torch_reference(comm, "kl_loss", teacher, family)
    tr, out["family"] = _parity_layout(comm, "kl_loss", want, samples, teacher, tp=2, pp=2, colocate=False,
                                       model_path=family)
    out["family"].update(_scales(want), model_type=tr.arch.model_type, qk_norm=tr.config.qk_layernorm,
                         rope_llama3=tr.arch.rope_llama3 is not None, sync_cost=_sync_cost_vs_export(comm, tr))
    return out


def _sync_cost_vs_export(comm: Any, tr: Any) -> dict[str, Any]:
    """Issue 33 item 4: each PP stage leader's real export (TP-gathered, HF names) against the tensors that
    milehpc.weights.cost describes for its stage: the same names, shapes, dtypes and bytes (Megatron's order within
    a layer differs from HF's, so they are compared sorted)."""
    from milehpc.weights import cost

    mine = sorted((n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
                  for n, t in tr.export_weights())
    paper = cost.job_tensors(tr.job)
    layers = tr.job.trainer.pp * len(tr.module.decoder.layers)
    out: dict[str, Any] = {"stages": 0, "equal": True, "stage_bytes": []}
    for stage, got in sorted((st, got) for st, got in comm.allgather((tr.pp_rank, mine)) if got):
        want = sorted((t.name, t.shape, t.dtype, t.nbytes) for t in cost.stage_tensors(paper, layers, tr.pp, stage))
        out["stages"] += 1
        out["equal"] = out["equal"] and got == want
        out["stage_bytes"].append(sum(g[3] for g in got))
    out["paper_bytes"] = sum(t.nbytes for t in paper)
    return out


WIDEST = max(64, 48, V)  # the parity model's widest layer (hidden, MLP, vocabulary; tests/family_models.SHAPE alike)
DEPTH = 2 + 2  # chained reductions of a gradient: its layers, the embedding and the head


def grads_tolerance(samples: list[Any]) -> float:
    """How far two fp32 computations of the same gradient may differ, relative to the largest gradient, when they
    reduce in another order (TP/PP/DP splits, other kernels): the probabilistic rounding-error bound (Higham & Mary,
    SIAM J. Sci. Comput. 41(5), 2019): a reduction of n terms errs by at most lambda * sqrt(n) * u times its terms'
    magnitude (u = 2**-24) with probability at least 1 - 2 exp(-lambda**2 / 2). lambda = 7 keeps that above
    1 - 1e-5 for all of the model's ~50k parameters at once; n is the longest reduction (the batch's tokens times the
    widest layer), chained through DEPTH reductions. The compared gradients are the second step's: the first
    step's Adam update is made noise-free by ``adam_eps`` (see :func:`_parity_job`), so the first step adds no
    more than its own rounding."""
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return 7.0 * DEPTH * math.sqrt(tokens * WIDEST) * 2.0**-24


def _scales(want: dict[str, Any]) -> dict[str, Any]:
    """The torch trainer's KL and largest gradients, and the gradients' relative tolerance: what the tolerances
    scale with."""
    out = {"torch_kl": want["kl"], "grads_max": max(float(g.abs().max()) for g in want["grads"].values()),
           "grads_tol": grads_tolerance(_parity_samples())}
    if want["critic_grads"] is not None:
        out["torch_value_loss"] = want["value_loss"]
        out["critic_grads_max"] = max(float(g.abs().max()) for g in want["critic_grads"].values())
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


_CRITIC_CKPT: dict[str, Any] = {}  # the critic as saved by _resume_with_critic (full, HF names)


def _resume_with_critic(comm: Any, tr: Any, samples: list[Any], work: str) -> dict[str, Any]:
    """The critic is in the dist checkpoint (model and optimizer): a resumed trainer's next step equals the
    uninterrupted one's, bit for bit (loss, value loss, policy and critic weights). So it is in the per-rank state
    of a run without a checkpoint directory (same layout)."""
    import copy

    from milehpc.train.megatron import checkpoint
    from milehpc.train.megatron.trainer import MegatronTrainer

    path = f"{work}/dist-ckpt-critic"
    local = copy.deepcopy(tr.state_dict_for_checkpoint())  # no dist_checkpoint_root: this rank's shards
    checkpoint.save(tr, path)
    _CRITIC_CKPT.update(path=path, weights=_stage_exports(comm, tr.critic.export), steps=tr.steps)
    want = tr.train_step(samples, 2)
    after, critic_after = _full_weights(comm, tr), _stage_exports(comm, tr.critic.export)
    again = MegatronTrainer(tr.job, pad_id=0, vocab_size=V)
    fresh = _stage_exports(comm, again.critic.export)
    checkpoint.load(again, path)
    got = again.train_step(samples, 2)
    again.load_checkpoint_state(local)  # back to the saved step, through the per-rank state
    local_step = again.train_step(samples, 2)
    return {"critic_local_resume_diffs": [abs(local_step[k] - want[k]) for k in ("train/loss", "critic/grad_norm")],
            "critic_local_resume_critic_maxdiff": _maxdiff(critic_after, _stage_exports(comm, again.critic.export)),
            "critic_resume_loss_diff": abs(got["train/loss"] - want["train/loss"]),
            "critic_resume_value_loss_diff": abs(got["train/critic/value_loss"] - want["train/critic/value_loss"]),
            "critic_resume_grad_norm_diff": abs(got["critic/grad_norm"] - want["critic/grad_norm"]),
            "critic_resume_weights_maxdiff": _maxdiff(after, _full_weights(comm, again)),
            "critic_resume_critic_maxdiff": _maxdiff(critic_after, _stage_exports(comm, again.critic.export)),
            "critic_fresh_vs_saved": _maxdiff(fresh, _CRITIC_CKPT["weights"])}


def _reshard_critic(comm: Any, tr: Any, work: str) -> dict[str, Any]:
    """The checkpoint written at TP=world loads at PP=world: the critic's weights, resharded, are the saved ones."""
    from milehpc.train.megatron import checkpoint

    checkpoint.load(tr, _CRITIC_CKPT["path"])
    return {"critic_reshard_maxdiff": _maxdiff(_CRITIC_CKPT["weights"], _stage_exports(comm, tr.critic.export)),
            "critic_reshard_steps": [tr.steps, _CRITIC_CKPT["steps"]]}


# ---- issue 33: batching like the large stacks, Megatron's memory features --------------------------------------

def _batching_job(*, tp: int = 1, pp: int = 1, layers: int = 2, **trainer: Any) -> Any:
    """The parity model (no clipping, Adam's eps above the fp32 noise: see :func:`_parity_job`), GRPO, a rollout
    batch of the 6 parity samples (2 prompts x 3)."""
    from milehpc.config.load import job_from_dict

    model = {"hidden_size": 64, "num_layers": layers, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48}
    return job_from_dict({"name": "batching", "model": model,
                          "rollout": {"temperature": 0.8, "prompts_per_step": 2, "n_samples": 3},
                          "trainer": {"backend": trainer.pop("backend", "megatron"), "tp": tp, "pp": pp,
                                      "micro_batch_size": 2, "lr": 1e-2, "clip_grad": 0.0, "adam_eps": 1e-4,
                                      **trainer}})


def _megatron_step(comm: Any, job: Any, samples: list[Any], *, watch: Any = None) -> dict[str, Any]:
    """One train step of a fresh Megatron trainer: its metrics, the last optimizer step's gradients and the weights
    after (every stage's, merged, on every rank); ``watch(trainer)`` runs before the step (hooks)."""
    from milehpc.train.megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(job, pad_id=0, vocab_size=V)
    seen = watch(tr) if watch is not None else None
    metrics = tr.train_step(samples, 0)
    return {"metrics": metrics, "grads": _stage_exports(comm, lambda: tr.export_weights(grads=True)),
            "weights": _stage_exports(comm, tr.export_weights), "seen": seen, "trainer": tr}


def _count_calls(tr: Any) -> dict[str, Any]:
    """Forward calls of the first layer and of its core attention, each layer input's shape [s, b, h] (what
    recomputation repeats and sequence parallelism splits), and the bytes autograd saves in each micro-batch's forward
    (tests/memory_measure.py; what recomputation and sequence parallelism cut)."""
    from memory_measure import SavedTensors

    layer = tr.module.decoder.layers[0]
    seen: dict[str, Any] = {"layer": 0, "core_attention": 0, "shapes": [], "saved": []}
    real = tr.module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with SavedTensors(tr.module.parameters()) as saved:
            out = real(*args, **kwargs)
        seen["saved"].append(saved.bytes)
        return out

    tr.module.forward = forward

    def on_layer(module: Any, args: Any, kwargs: Any) -> None:
        seen["layer"] += 1
        seen["shapes"].append(list((args[0] if args else kwargs["hidden_states"]).shape))

    def on_attention(*_: Any) -> None:
        seen["core_attention"] += 1

    layer.register_forward_pre_hook(on_layer, with_kwargs=True)
    layer.self_attention.core_attention.register_forward_pre_hook(on_attention)
    return seen


def _against(want: dict[str, Any], got: dict[str, Any], tol: float) -> dict[str, Any]:
    """Loss, gradients (every parameter) and the gradients' scale of two steps of the same batch."""
    return {"loss_diff": abs(got["metrics"]["train/loss"] - want["metrics"]["train/loss"]),
            "grads_maxdiff": _maxdiff(got["grads"], want["grads"]),
            "grads_bound": tol * max(float(g.abs().max()) for g in want["grads"].values())}


def check_batching(comm: Any, work: str) -> dict[str, Any]:
    """Issue 33 items 2 and 3 on the 2-rank pair. Mini-batches (trainer.mini_batch_size = 3 of 6: two optimizer
    steps) at TP=2 against the torch trainer's (one rank): the second step's gradients and the reported loss; one
    mini-batch (mini_batch_size = 6) against the plain step, bit for bit. Token-budget micro-batches (packed up to 16
    tokens) at PP=2 against PP=2's plain micro-batches. Full and selective recomputation and sequence parallelism at
    TP=2 against plain TP=2: loss and gradients, and the forward calls (a recomputed layer / core attention runs
    twice) and the layer input's sequence length (split over TP) that show each is on."""
    import types
    from unittest import mock

    from milehpc.samples.batch import to_batch
    from milehpc.train import torch_trainer
    from milehpc.train.megatron import packing

    start = time.perf_counter()
    samples = _parity_samples()
    tol = grads_tolerance(samples)
    out: dict[str, Any] = {"grads_tol": tol}
    def torch_step(batch: list[Any], mini_batch_size: int) -> dict[str, Any]:
        """The torch trainer's step on one rank (computed on rank 0, broadcast): metrics, last step's gradients."""
        if comm.Get_rank() != 0:
            return comm.bcast(None, root=0)
        with mock.patch.object(torch_trainer, "_dist", return_value=(0, 1)):
            tt = torch_trainer.TorchTrainer(_batching_job(backend="torch", mini_batch_size=mini_batch_size),
                                            types.SimpleNamespace(pad_id=0, eos_id=2, vocab_size=V))
            seen: dict[str, Any] = {}
            tt.optimizer.register_step_pre_hook(lambda *_: seen.update(
                {n: p.grad.detach().clone() for n, p in tt.module.named_parameters()}))
            metrics = tt.train_step(batch, 0)
        return comm.bcast({"metrics": metrics, "grads": seen}, root=0)

    # Mini-batches against the torch trainer (the same 2 mini-batches of 3).
    ref = torch_step(samples, 3)
    mini = _megatron_step(comm, _batching_job(tp=2, mini_batch_size=3), samples)
    out["mini_vs_torch"] = _against(ref, mini, tol)
    # At DP=2 each rank holds one group and cuts it in 3 (mini_batch_size = 2 of 6): global mini-batch k = row k of
    # each group, normalised by its tokens on both ranks; on one rank the same mini-batches are the rows in that order.
    mine = [s for s in samples if s.group == comm.Get_rank()]
    dp2 = _megatron_step(comm, _batching_job(dp=2, mini_batch_size=2), mine)
    out["mini_dp2_vs_torch"] = _against(torch_step([samples[i] for i in (0, 3, 1, 4, 2, 5)], 2), dp2, tol)
    out["mini_ratio_max"] = mini["metrics"]["train/actor/ratio_max"]  # the second step's ratio is off 1
    out["torch_ratio_max"] = ref["metrics"]["train/actor/ratio_max"]
    plain = _megatron_step(comm, _batching_job(tp=2), samples, watch=_count_calls)
    one = _megatron_step(comm, _batching_job(tp=2, mini_batch_size=6), samples)
    out["one_mini_vs_plain_weights"] = _maxdiff(plain["weights"], one["weights"])
    out["one_mini_vs_plain_loss"] = abs(plain["metrics"]["train/loss"] - one["metrics"]["train/loss"])
    out["mini_vs_plain_weights"] = _maxdiff(plain["weights"], mini["weights"])  # two steps move them elsewhere
    out["plain_calls"] = {k: plain["seen"][k] for k in ("layer", "core_attention")}
    out["plain_seq"] = plain["seen"]["shapes"][0][0]
    out["plain_saved"] = max(plain["seen"]["saved"])
    for name, trainer in (("full", {"recompute": "full"}), ("selective", {"recompute": "selective"}),
                          ("sp", {"sequence_parallel": True})):
        got = _megatron_step(comm, _batching_job(tp=2, **trainer), samples, watch=_count_calls)
        out[name] = {**_against(plain, got, tol), "calls": {k: got["seen"][k] for k in ("layer", "core_attention")},
                     "seq": got["seen"]["shapes"][0][0], "packed": got["trainer"].packed,
                     "saved": max(got["seen"]["saved"]),
                     "config": [got["trainer"].config.recompute_granularity, got["trainer"].config.sequence_parallel]}
        if name == "sp":  # the packed length the schedule ran (the layer input holds 1/TP of it)
            batch = to_batch(samples, 0)
            out[name]["packed_length"] = max(packing.packed_length(mb.attention_mask) for mb in batch.split(2))
    # PP=2 on 4 layers: the plain layout of both the token budget and the virtual stages.
    pp_plain = _megatron_step(comm, _batching_job(pp=2, layers=4), samples)
    budget = _megatron_step(comm, _batching_job(pp=2, layers=4, max_tokens_per_micro_batch=16), samples)
    out["budget"] = _against(pp_plain, budget, tol)
    tr = budget["trainer"]
    pairs = tr._micro_pairs(tr._batch(samples))
    out["budget"].update(micro_batches=len(pairs), plain_micro_batches=len(pp_plain["trainer"]._micro_batches(
        tr._batch(samples))), bin_tokens=[int(mb.attention_mask.sum()) for _, mb in pairs],
        logprobs_diff=max(abs(a - b) for x, y in zip(pp_plain["trainer"].compute_logprobs(samples),
                                                      tr.compute_logprobs(samples), strict=True)
                          for a, b in zip(x, y, strict=True)))
    out["vpp"] = _virtual_stages(comm, samples, tol, work, pp_plain)
    out["seconds"] = time.perf_counter() - start
    return out


def _virtual_stages(comm: Any, samples: list[Any], tol: float, work: str, plain: dict[str, Any]) -> dict[str, Any]:
    """Virtual pipeline stages: a 4-layer model at PP=2 x VPP=2 (each rank two chunks of one layer, interleaved 1F1B;
    3 micro-batches padded to 4) against plain PP=2 (two layers per rank): the step's loss and gradients; the layers
    each chunk holds; its dist checkpoint loads into the plain PP=2 trainer (the sharded keys are global)."""
    from milehpc.train.megatron import checkpoint
    from milehpc.train.megatron.trainer import MegatronTrainer

    vpp = _megatron_step(comm, _batching_job(pp=2, layers=4, vpp=2), samples)
    tr = vpp["trainer"]
    out = _against(plain, vpp, tol)
    out["chunk_layers"] = comm.allgather([[int(layer.layer_number) for layer in chunk.decoder.layers]
                                         for chunk in tr.module.parts])
    out["micro_batches"] = len(tr._micro_batches(tr._batch(samples)))
    path = f"{work}/dist-ckpt-vpp"
    checkpoint.save(tr, path)
    again = MegatronTrainer(_batching_job(pp=2, layers=4), pad_id=0, vocab_size=V)
    checkpoint.load(again, path)
    out["reload_plain_vs_saved"] = _maxdiff(vpp["weights"], _stage_exports(comm, again.export_weights))
    out["reload_steps"] = again.steps
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_torch_distributed(comm: Any) -> None:
    import torch.distributed as dist

    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())


def main() -> None:
    """Groups that need 4 ranks run first on the whole world (launched with -np 4); then ranks 0-1 carry on alone in
    a fresh 2-rank process group (one launch: importing megatron, torch and transformers costs seconds per rank)."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from mpi4py import MPI

    out_path, work = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    _init_torch_distributed(comm)
    results: dict[str, Any] = {"launch_world_size": comm.Get_size()}
    from milehpc.train.megatron import cpu_adapt

    cpu_adapt.apply()  # turns the device check on (MILEHPC_DEVICE_CHECK) before any group is used
    wide = {"parity4": check_parity_tp2pp2, "colocated": check_colocated_loop}
    groups = {"logits": check_logits, "path": check_from_path, "ckpt": check_ckpt, "replay": check_replay,
              "devices": check_devices, "parity": check_parity, "batching": check_batching}
    needs_work = {"parity4", "colocated", "path", "ckpt", "parity", "batching"}

    def run(name: str, fn: Any, on: Any) -> None:
        results[name] = fn(on, work) if name in needs_work else fn(on)

    # An optional third argument runs only the named groups (comma-separated), e.g. while working on one.
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else [*(wide if comm.Get_size() == 4 else ()), *groups]
    for name in (n for n in only if n in wide):
        if comm.Get_size() != 4:
            raise SystemExit(f"group {name!r} needs 4 ranks (mpirun -np 4), got {comm.Get_size()}")
        run(name, wide[name], comm)
    pair = comm
    if comm.Get_size() > 2:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        pair = comm.Split(0 if comm.Get_rank() < 2 else MPI.UNDEFINED)
        if pair == MPI.COMM_NULL:
            return
        _init_torch_distributed(pair)
    results["world_size"] = dist.get_world_size()
    for name in (n for n in only if n in groups):
        run(name, groups[name], pair)
    if comm.Get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
