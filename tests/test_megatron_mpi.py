"""The Megatron-core trainer for real on the CPU (gloo), under real mpirun.

Two launches only (importing megatron, torch and transformers costs seconds per rank):

* ``tests/megatron_checks.py`` on 4 ranks (the TP=2 x PP=2 parity; the colocated loop at TP=2 x DP=2), then 2 of
  them: Megatron vs HF logits/logprobs/entropy at TP=2, the export at TP=2, dist checkpoint save -> resume
  (bit-exact) and resume at another TP (TP=1 x DP=2), MoE routing replay (EP=2), all under the device check (a CPU tensor reaching a
  collective of an NCCL group fails, as on a GPU); and the same batch through the torch trainer and the Megatron
  trainer (TP=1 x DP=2, TP=2, PP=2, TP=2 x PP=2) with a KL reference, a critic (PPO/GAE) and a teacher
  (distillation): same loss, KL, value loss, policy and critic gradients.
* the RL loop through ``milehpc run --site local``: GRPO + KL with Megatron trainer ranks at PP=2 x DP=2 (4 ranks, the
  distributed optimizer) and the reference engine on a 5th rank; after every weight sync (Megatron -> HF converter, one
  sync group per pipeline stage) the engine's logprobs match the trainer's (TP=2 in the loop: the reshard and the
  bit-exact resume in tests/test_ckpt_reshard_mpi.py; TP=2 x PP=2 against the torch
  trainer: the parity launch above); periodic checkpoints go through dist_checkpointing; the
  engine evaluates held-out prompts greedily, and the checkpoint exported with ``milehpc export`` generates the same
  tokens in ``transformers``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_model import TINY_MODEL

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("megatron")
    out = work / "out.json"
    cmd = [str(BIN / "mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4",
           sys.executable, str(ROOT / "tests" / "megatron_checks.py"), str(out), str(work)]
    # The device check (milehpc.comm.devcheck): the whole launch runs as if its gloo groups were NCCL groups.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**ENV, "MILEHPC_DEVICE_CHECK": "nccl"},
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_megatron_logits_match_hf_at_tp2(checks: dict) -> None:
    assert checks["launch_world_size"] == 4 and checks["world_size"] == 2
    got = checks["logits"]
    for arch in ("qwen2", "llama"):
        assert got[f"{arch}_padded_vocab"] == 38  # 37 padded for TP=2; the padded column is masked
        assert got[f"{arch}_export_vs_hf"] == 0.0  # HF -> TP shards -> gathered export: exact
        assert got[f"{arch}_logits_maxdiff"] < 2e-6
        assert got[f"{arch}_logprob_maxdiff"] < 2e-6
        assert got[f"{arch}_entropy_maxdiff"] < 5e-6
    # Issue 33: the export is lazy, one TP gather per parameter as the sync takes it (2 layers: 10 gathered params);
    # the old one gathered the whole stage before its first tensor came out.
    at_first, gathers = got["export_gathers"]
    assert at_first == 1 and gathers >= 10, got["export_gathers"]


def test_model_from_a_local_hf_checkpoint(checks: dict) -> None:
    assert checks["path"]["path_layers"] == 2  # from the folder's config.json, not the job's [model] table
    assert checks["path"]["path_export_vs_hf"] == 0.0


def test_dist_checkpoint_resume_is_bit_exact_and_reshards(checks: dict) -> None:
    got = checks["ckpt"]
    assert got["tp2_version"] == 2
    assert got["tp2_reload_vs_saved"] == 0.0
    assert got["tp2_resume_step_vs_uninterrupted"] == 0.0  # model and distributed-optimizer state exact
    assert got["tp1dp2_reload_vs_saved"] == 0.0  # TP=2 -> TP=1 x DP=2: the same weights
    # The next step at another layout differs only by reduction order.
    assert got["tp1dp2_resume_step_vs_uninterrupted"] < 1e-4


def test_colocated_megatron_tp2_dp2_every_engine_holds_the_trainers_weights_after_each_sync(checks: dict) -> None:
    """Issue 30 fault 4: the colocated loop (milehpc's bootstrap and loop, reference engines, the device check on),
    Megatron at TP=2 x DP=2 on the same 4-rank launch: Megatron exports the model on tp0/dp0 only, and the engines
    of the other three ranks kept their initial weights (they received no tensor; the logprob check caught it one
    step later). Now every engine, after each of its loads (the initial sync and one per step), holds exactly the
    trainer's export of that version, every tensor of it, and the steps moved the weights."""
    got = checks["colocated"]
    assert got["versions"] == [[0, 1, 2]] * 4  # every rank's engine loaded at every sync
    assert got["missing"] == [] and got["maxdiff"] == 0.0, got
    assert got["tensors"] == 27 and got["trained"] > 1e-3  # 2 layers x 11 + embed, norm, lm_head...; not vacuous
    assert got["steps"] == [0, 1] and got["logprob_diff_max"] < 1e-5


def test_device_check_is_on_and_dp_reductions_use_the_collective_device(checks: dict) -> None:
    """Fault 8 of issue 12: with DP > 1 the trainers all-reduced CPU float64 tensors, which NCCL refuses. Under the
    device check the whole launch above (DP=2 training steps included) ran without a placement error."""
    got = checks["devices"]
    assert got["enabled"] and got["simulating"]
    assert got["cpu_tensor_caught"]  # the check is live
    assert got["violations_before"] == 0
    assert got["torch_all_reduce"] == [2.0, 1.0] and got["torch_all_reduce_max"] == [1.0]
    assert got["megatron_dp_sum"] == [2.0, 1.0] and got["megatron_dp_max"] == [1.0]


def test_routing_replay_gives_the_engines_experts(checks: dict) -> None:
    got = checks["replay"]
    assert got["replay_total"] > 50
    assert got["replay_identical"] == got["replay_total"]
    # Without replay the trainer (one version ahead) routes differently: the test can tell the two apart.
    assert got["free_identical"] < got["free_total"]


@pytest.mark.parametrize("kl", ["kl_loss", "kl_reward"])
def test_megatron_matches_the_torch_trainer_with_a_kl_reference(checks: dict, kl: str) -> None:
    """Issue 17 item 1: the second step of GRPO with the KL in the loss (k3) or in the reward (k1), the policy one
    step away from the reference. Megatron at TP=1 x DP=2 (each DP rank one group), TP=2 and TP=1 x PP=2 vs the
    torch trainer on one rank: the same gradients (HF names; norm only with PP) and the same reported loss (at DP=2
    too: each micro-batch's loss is its share of the step's, added up over micro-batches and DP ranks), and at DP=1
    the same KL."""
    got = checks["parity"][kl]
    assert got["torch_kl"] > 0.05  # the reference differs from the policy: the KL and its gradient are live
    for layout in ("tp1", "tp2", "pp2"):
        assert got[f"{layout}_grad_norm_rel"] < 1e-5, got
        assert got[f"{layout}_frozen_trainable"] == 0  # frozen: no gradients, no optimizer state
        assert got[f"{layout}_grads_maxdiff"] < got["grads_tol"] * got["grads_max"], got  # every parameter
    for layout in ("tp1", "tp2", "pp2"):
        assert got[f"{layout}_loss_diff"] < 1e-6, got
    for layout in ("tp2", "pp2"):
        assert got[f"{layout}_kl_diff"] < 1e-6 * got["torch_kl"] + 1e-7, got
    # At DP=2 the step's loss (the backpropagated micro-batch losses over micro-batches and DP ranks) is comparable.
    assert got["tp1_step_loss_diff"] < 1e-6, got
    assert got["tp1_frozen_moves"] == got["pp2_frozen_moves"] == []  # not colocated: the reference stays on the GPU
    assert got["tp2_frozen_moves"] == ["cuda:0", "cpu"] * 2  # colocated: in for each step's pass, out again


def test_megatron_matches_the_torch_trainer_with_a_critic(checks: dict) -> None:
    """Issue 17 item 1: PPO with GAE, second step (the critic one update away from its initial weights, so the
    values, the returns and the value clipping differ from step one's). Megatron's critic (its own GPT model with a
    value head, own DDP and optimizer) at TP=1 x DP=2, TP=2 and PP=2 vs the torch trainer's critic: the same policy
    AND critic gradients, every parameter, and the same reported loss and value loss (at DP=2 too)."""
    got = checks["parity"]["gae"]
    assert got["torch_value_loss"] > 1e-3 and got["critic_grads_max"] > 1e-2  # the critic's loss is live
    for layout in ("tp1", "tp2", "pp2"):
        assert got[f"{layout}_grad_norm_rel"] < 1e-5 and got[f"{layout}_critic_grad_norm_rel"] < 1e-5, got
        assert got[f"{layout}_grads_maxdiff"] < got["grads_tol"] * got["grads_max"], got
        assert got[f"{layout}_critic_grads_maxdiff"] < got["grads_tol"] * got["critic_grads_max"], got
    for layout in ("tp1", "tp2", "pp2"):  # DP=2 too: the reported losses are sums of step-normalised shares
        assert got[f"{layout}_loss_diff"] < 1e-6 and got[f"{layout}_value_loss_diff"] < 1e-6, got


def test_megatron_matches_the_torch_trainer_with_a_teacher(checks: dict) -> None:
    """Issue 17 item 1: on-policy distillation from a teacher of another architecture (Llama, 4 layers; the student
    is a 2-layer Qwen2) loaded from a local HF folder, sharded like the policy and frozen; offloaded between uses
    when colocated, like the reference. (The advantages are ~3x larger than GRPO's here: fp32 noise scales.)"""
    got = checks["parity"]["distill"]
    for layout in ("tp1", "tp2", "pp2"):
        assert got[f"{layout}_grad_norm_rel"] < 1e-5, got
        assert got[f"{layout}_grads_maxdiff"] < got["grads_tol"] * got["grads_max"], got
        assert got[f"{layout}_frozen_trainable"] == 0
    for layout in ("tp1", "tp2", "pp2"):
        assert got[f"{layout}_loss_diff"] < 1e-6, got
    assert got["tp1_step_loss_diff"] < 1e-6, got
    assert got["tp1_frozen_moves"] == []
    # colocated (TP=2), or not colocated with trainer.options.offload_frozen (PP=2): in for each step, out again
    assert got["tp2_frozen_moves"] == got["pp2_frozen_moves"] == ["cuda:0", "cpu"] * 2


def test_megatron_matches_the_torch_trainer_at_tp2_pp2(checks: dict) -> None:
    """Issue 17 item 1 on 4 ranks: TP=2 x PP=2 with the KL reference, the critic and the teacher: the same loss
    (KL, value loss) and gradients as the torch trainer's."""
    for name in ("kl_loss", "gae", "distill", "family"):  # the others: ..._on_every_estimator_and_loss
        got = checks["parity4"][name]
        assert got["layout"] == [2, 2, 1]  # TP, PP, DP
        assert got["loss_diff"] < 1e-6 and got["grad_norm_rel"] < 1e-5, (name, got)
        assert got["grads_maxdiff"] < got["grads_tol"] * got["grads_max"], (name, got)
        assert got["frozen_trainable"] == 0
    kl = checks["parity4"]["kl_loss"]
    assert kl["torch_kl"] > 0.05 and kl["kl_diff"] < 1e-6 * kl["torch_kl"] + 1e-7, kl
    gae = checks["parity4"]["gae"]
    assert gae["value_loss_diff"] < 1e-6 and gae["critic_grad_norm_rel"] < 1e-5, gae
    assert gae["critic_grads_maxdiff"] < gae["grads_tol"] * gae["critic_grads_max"], gae
    assert sorted(checks["parity4"]) == sorted(["distill", "family", "gae", "kl_loss", *LIVE])
    # A Qwen3 folder with Llama 3.x RoPE scaling (tests/model_family_checks.py has every family at TP=1).
    family = checks["parity4"]["family"]
    assert (family["model_type"], family["qk_norm"], family["rope_llama3"]) == ("qwen3", True, True)


def test_the_sync_cost_model_describes_megatrons_stage_exports(checks: dict) -> None:
    """Issue 33 item 4: at TP=2 x PP=2 each stage leader's real export has the names, shapes, dtypes and bytes that
    milehpc.weights.cost describes for its stage (the model behind `milehpc plan`'s sync estimate)."""
    got = checks["parity4"]["family"]["sync_cost"]
    assert got["stages"] == 2 and got["equal"], got
    assert sum(got["stage_bytes"]) == got["paper_bytes"] and min(got["stage_bytes"]) > 0, got


def test_the_parity_covers_every_estimator_loss_and_aggregation_mode() -> None:
    """Issue 17 item 1: every registered advantage estimator and policy loss, every aggregation mode, clip-higher,
    TIS and MIS and the entropy bonus are in some parity configuration (tests/megatron_checks.py)."""
    from megatron_checks import PARITY_ALGORITHMS, PARITY_MODES

    from milehpc import plugins
    from milehpc.algorithms.aggregation import MODES

    configs = [*PARITY_ALGORITHMS.values(), *PARITY_MODES.values()]
    assert {c.get("advantage", "grpo") for c in configs} == set(plugins.registry("advantage"))
    assert {c.get("loss", "ppo_clip") for c in configs} == set(plugins.registry("loss"))
    assert {c.get("loss_agg_mode", "token-mean") for c in configs} == set(MODES)
    assert {c.get("off_policy_correction") for c in configs} >= {"tis", "mis"}
    assert any(c.get("loss_params", {}).get("clip_high", 0.2) > c.get("loss_params", {}).get("clip_low", 0.2)
               for c in configs)
    assert any(c.get("entropy_coef") for c in configs) and any(c.get("gamma", 1.0) < 1 for c in configs)


# What shows each configuration's own term at work in the torch trainer's second step (no vacuous parity).
LIVE = {
    "rloo": lambda g: g["torch_entropy"] > 1 and g["torch_advantages_abs_mean"] > 0.1,
    "reinforce_pp": lambda g: g["torch_kl"] > 0.05 and g["torch_advantages_abs_mean"] > 0.1,
    "dr_grpo": lambda g: g["torch_clip_frac"] > 0.05 and 0 < g["torch_off_policy_weight_mean"] < 0.9,
    "reinforce_pp_baseline": lambda g: 0.05 < g["torch_off_policy_rejected"] < 0.95 and g["torch_entropy"] > 1,
    "sft": lambda g: g["torch_step_loss"] > 1,
}


@pytest.mark.parametrize("name", sorted(LIVE))
def test_megatron_matches_the_torch_trainer_on_every_estimator_and_loss(checks: dict, name: str) -> None:
    """Issue 17 item 1: the second step of each configuration (megatron_checks.PARITY_MODES: RLOO + GSPO,
    REINFORCE++ (gamma < 1, whitened over both DP ranks) + policy gradient + token-sum + k2 KL, Dr. GRPO +
    clip-higher + overlong penalty + TIS over two epochs, REINFORCE++-baseline + entropy + MIS, SFT) through the
    Megatron trainer at TP=1 x DP=2 (each DP rank one group) and TP=2 x PP=2 vs the torch trainer on one rank: the
    same step loss (the backpropagated micro-batch losses, summed over micro-batches and DP ranks) and gradients;
    the same reported loss too (at DP=2: the shares added up)."""
    got, four = checks["parity"][name], checks["parity4"][name]
    assert LIVE[name](got), got
    loss_tol = 1e-6 * (1.0 + abs(got["torch_step_loss"]))
    assert got["tp1_layout"] == [1, 1, 2] and four["layout"] == [2, 2, 1]
    for layout, figures in (("tp1_", got), ("", four)):
        assert figures[f"{layout}step_loss_diff"] < loss_tol, (layout, figures)
        assert figures[f"{layout}grad_norm_rel"] < 1e-5, (layout, figures)
        # megatron_checks.grads_tolerance: the fp32 rounding bound of the gradient's reductions
        assert figures[f"{layout}grads_maxdiff"] < figures["grads_tol"] * figures["grads_max"], (layout, figures)
    # The reported train/loss too (epochs averaged alike; at DP=2 the micro-batches' step-normalised shares added up)
    assert four["loss_diff"] < loss_tol and got["tp1_loss_diff"] < loss_tol, (got, four)
    if name == "reinforce_pp":
        assert four["kl_diff"] < 1e-6 * got["torch_kl"], four


def test_megatron_critic_resumes_bit_exactly_and_reshards(checks: dict) -> None:
    """The critic (model and optimizer) is in the dist checkpoint: saved at TP=2 after two steps, a fresh trainer
    (whose critic differs from the saved one) loads it and its next step is bit-identical to the uninterrupted
    one's; loaded at PP=2 (resharded), the critic's weights are exactly the saved ones."""
    got = checks["parity"]["gae"]
    assert got["critic_fresh_vs_saved"] > 1e-3  # the load has something to do
    assert got["critic_resume_loss_diff"] == got["critic_resume_value_loss_diff"] == 0.0
    assert got["critic_resume_grad_norm_diff"] == 0.0
    assert got["critic_resume_weights_maxdiff"] == got["critic_resume_critic_maxdiff"] == 0.0
    assert got["critic_reshard_maxdiff"] == 0.0 and got["critic_reshard_steps"] == [2, 2]
    # Without a checkpoint directory: the per-rank state holds the critic too.
    assert got["critic_local_resume_diffs"] == [0.0, 0.0] and got["critic_local_resume_critic_maxdiff"] == 0.0


def test_megatron_kl_reference_is_rebuilt_on_resume(checks: dict) -> None:
    """The reference is not in the dist checkpoint: the resumed trainer rebuilds it from the initial weights and
    its next step (KL included) is bit-identical to the uninterrupted one's."""
    got = checks["parity"]["kl_loss"]
    assert got["resume_kl"] > 0.05
    assert got["resume_loss_diff"] == got["resume_kl_diff"] == got["resume_weights_maxdiff"] == 0.0


def _same_step(got: dict, tol_loss: float = 1e-6) -> None:
    """Loss and every parameter's gradient within the fp32 reordering bound (megatron_checks.grads_tolerance)."""
    assert got["loss_diff"] < tol_loss, got
    assert got["grads_maxdiff"] < got["grads_bound"], got


def test_megatron_mini_batches_follow_the_torch_trainers_and_one_is_todays_step(checks: dict) -> None:
    """Issue 33 item 2: trainer.mini_batch_size = 3 of the 6 samples, Megatron at TP=2 (and 2 of 6 at DP=2, a group per
    rank): several optimizer steps, the last one's gradients (its importance ratio off 1: against the policy before
    the first step) and the reported loss equal the torch trainer's (tests/test_batching.py checks that one against
    verl's update written out). One mini-batch of 6 is today's step: the same weights, bit for bit."""
    got = checks["batching"]
    _same_step(got["mini_vs_torch"])
    _same_step(got["mini_dp2_vs_torch"])  # TP=1 x DP=2: three mini-batches, each's tokens counted over both ranks
    assert got["mini_ratio_max"] > 1.01 and abs(got["mini_ratio_max"] - got["torch_ratio_max"]) < 1e-5, got
    assert got["one_mini_vs_plain_weights"] == 0.0 and got["one_mini_vs_plain_loss"] == 0.0, got
    assert got["mini_vs_plain_weights"] > 1e-3  # two steps are not one: the comparison can tell


def test_megatron_token_budget_micro_batches_equal_the_plain_path(checks: dict) -> None:
    """Issue 33 item 2: trainer.max_tokens_per_micro_batch = 16 at PP=2 (4 layers): the 6 sequences packed first-fit
    into rows of at most 16 tokens (two bins hold two sequences), each bin one packed micro-batch through the
    pipeline; loss, gradients and the logprobs equal PP=2's plain micro-batches of 2 rows within the fp32 bound."""
    got = checks["batching"]["budget"]
    _same_step(got)
    assert got["micro_batches"] == 4 and got["plain_micro_batches"] == 3, got
    assert max(got["bin_tokens"]) <= 16 and sum(got["bin_tokens"]) == 52, got
    assert got["logprobs_diff"] < 1e-5, got


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_megatron_recomputation_equals_the_plain_layout(checks: dict, mode: str) -> None:
    """Issue 33 item 3: trainer.recompute at TP=2: the same loss and gradients as plain TP=2 (the recomputed forward
    is the same forward), and it is on: full recomputation runs every layer twice per micro-batch (forward, and again
    in backward) and saves a fraction of the activations; selective recomputes the core attention alone."""
    got, plain = checks["batching"][mode], checks["batching"]
    _same_step(got)
    assert got["config"] == [mode, False]
    assert plain["plain_calls"] == {"layer": 3, "core_attention": 3}  # 3 micro-batches, once each
    if mode == "full":
        assert got["calls"] == {"layer": 6, "core_attention": 6}, got
        assert got["saved"] < 0.5 * plain["plain_saved"], (got, plain["plain_saved"])
    else:
        assert got["calls"] == {"layer": 3, "core_attention": 6}, got
        assert got["saved"] < plain["plain_saved"], (got, plain["plain_saved"])


def test_megatron_sequence_parallel_equals_tp2(checks: dict) -> None:
    """Issue 33 item 3: trainer.sequence_parallel at TP=2 on the local spec (milehpc's sequence-parallel RMSNorm, whose
    weight gradients finalize_model_grads sums over TP): the same loss and gradients as plain TP=2, each layer's input
    half of the packed row (the sequence split over the TP group), fewer bytes saved for backward."""
    got, plain = checks["batching"]["sp"], checks["batching"]
    _same_step(got)
    assert got["config"] == [None, True] and got["packed"]
    assert got["seq"] * 2 == got["packed_length"] and plain["plain_seq"] == 11, got
    assert got["saved"] < plain["plain_saved"], (got, plain["plain_saved"])


def test_megatron_virtual_pipeline_stages_equal_plain_pp2(checks: dict) -> None:
    """Issue 33 item 3: trainer.vpp = 2 at PP=2 on a 4-layer model: each rank holds two chunks of one layer (rank 0
    layers 1 and 3, rank 1 layers 2 and 4: interleaved 1F1B), the 3 micro-batches padded to 4 (a multiple of PP) with
    fully masked ones; the step's loss and gradients equal plain PP=2's, and its dist checkpoint loads into the plain
    PP=2 trainer unchanged (the sharded keys are global)."""
    got = checks["batching"]["vpp"]
    _same_step(got)
    assert got["chunk_layers"] == [[[1], [3]], [[2], [4]]], got
    assert got["micro_batches"] == 4, got
    assert got["reload_plain_vs_saved"] == 0.0 and got["reload_steps"] == 1, got


JOB = """
name = "megatron-grpo"
""" + TINY_MODEL + """[data]
source = "task:reverse"
params = { min_len = 1, max_len = 5 }
[reward]
name = "megatron_checks:length_reward"
[rollout]
prompts_per_step = 4
n_samples = 4
max_new_tokens = 6
temperature = 0.8
[algorithm]
kl_coef = 0.05
kl_type = "low_var_kl"
[trainer]
backend = "megatron"
tp = 1
pp = 2
dp = 2
micro_batch_size = 4
lr = 1e-3
distributed_optimizer = true
[run]
steps = 3
loop = "sync"
check_logprobs = true
[checkpoint]
interval_steps = 2
[site]
ranks_per_node = 5
"""


def _run(tmp_path: Path, text: str) -> tuple[Path, list[dict]]:
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(text))
    rdir = tmp_path / "run"
    proc = subprocess.run([str(BIN / "milehpc"), "run", str(job), "--site", "local", "--run-dir", str(rdir)],
                          capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return rdir, _records(rdir)


def _records(rdir: Path) -> list[dict]:
    """metrics.jsonl; a resumed run appends, and the last record of a step wins."""
    last = {}
    for line in (rdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        last[record["step"]] = record
    return [last[k] for k in sorted(last)]


# In-loop evaluation (issue 16): greedy answers to 4 held-out prompts after steps 2 and 3, in 2 engine batches.
EVAL = ("[data]\n", '[data]\nval_source = "task:reverse"\n'), ("[run]\n", "[run]\neval_every = 2\n")
EVAL_TABLE = "[eval]\nmax_prompts = 4\nbatch_size = 2\n"


def test_grpo_with_megatron_pp2_dp2_and_reference_engine(tmp_path: Path) -> None:
    """... and issue 16's must-show: ``milehpc export`` of the PP=2 x DP=2 checkpoint after step 3 loads in
    ``transformers`` and greedy-generates the tokens the engine answered in the loop's evaluation of those weights."""
    from test_export import check_export_generates_the_loop_answers

    text = JOB
    for old, new in EVAL:
        text = text.replace(old, new)
    rdir, records = _run(tmp_path, text + EVAL_TABLE)
    assert [r["step"] for r in records] == [0, 1, 2]
    first = records[0]
    assert first["dist/mpi_world_size"] == 5 and first["dist/trainer_world_size"] == 4
    for r in records:
        # Engine (HF, weights synced stage by stage through the converter) vs Megatron on the same tokens.
        assert r["train/logprob_diff_max"] <= 1e-5, r
        assert r["train/tokens"] > 0 and r["train/grad_norm"] > 0, r
    # The KL reference (the initial policy) through the pipeline: 0 before the first update, then not.
    assert records[0]["train/actor/kl"] < 1e-6 < records[-1]["train/actor/kl"], records
    ckpt = rdir / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert (ckpt / "megatron" / "v00000002" / "metadata.json").is_file()
    assert [(r["step"], r["eval/weight_version"]) for r in records if "eval/prompts" in r] == [(1, 2), (2, 3)]
    assert sorted(p.name for p in (rdir / "evals").iterdir()) == ["step_00000001.jsonl", "step_00000002.jsonl"]
    record = check_export_generates_the_loop_answers(rdir, 3, tmp_path / "hf")
    assert record["weight_version"] == 3 and record["trainer_backend"] == "megatron", record
    assert (record["layout"]["tp"], record["layout"]["pp"], record["layout"]["dp"]) == (1, 2, 2), record
    answers = [json.loads(line)["response_ids"] for line in (rdir / "evals" / "step_00000002.jsonl").open()]
    assert len(answers) == 4 and sum(map(len, answers)) > 4, answers  # not 4 immediate EOS: tokens to compare
