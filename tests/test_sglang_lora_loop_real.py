"""``[trainer.lora]`` with ``rollout.engine = "sglang"`` under real mpirun, the REAL sglang engine on the CPU: one
torch trainer rank training two adapters (multi-LoRA: rev on digit reversal, srt on sorting; LoRA warm-up so the
adapters are far from zero before RL) and one SGLang rollout rank. The engine loads the trainer's seeded base from
disk once; each sync moves only the adapters (bucketed broadcast to the rollout rank) into SGLang's LoRA API, each
under a new name, and every step's prompts go to the engine in one batch, each request naming its own adapter's
(``lora_path``). The logprob check after every sync holds for every sample (seen failing: requests without the
adapter's name, or SGLang's dummy base instead of the trainer's, put the gap at 0.3-0.47).

The same launch kills the engine's real scheduler after its batch 1 (``MILEHPC_FAULT=scheduler:1@1``, rank 1 is the
rollout rank): the next sync finds the engine dead, restarts it in place with LoRA enabled and loads the synced
adapters before batch 2 is generated (seen failing before the restart existed: the run ended with "SGLang engine 0
is down")."""

from __future__ import annotations

from pathlib import Path

import pytest
from local_job import run_local_job
from required import require_module
from sglang_real import require_real_sglang

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=2), pytest.mark.timeout(900)]
require_module("peft")


def test_real_sglang_lora_syncs_the_adapter_only_logprobs_agree_and_a_restart_reloads_it(tmp_path: Path) -> None:
    require_real_sglang()
    records, log = run_local_job(tmp_path, """
        name = "sglang-lora"
        [data]
        source = "task:reverse"
        params = { min_len = 1, max_len = 4 }
        [rollout]
        engine = "sglang"
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 4
        temperature = 0.8
        [trainer]
        micro_batch_size = 8
        lr = 1e-2
        sft_warmup_steps = 2
        sft_lr = 1e-2
        [trainer.lora]
        rank = 4
        alpha = 8
        [trainer.lora.adapters.rev]
        source = "task:reverse"
        params = { min_len = 1, max_len = 4 }
        [trainer.lora.adapters.srt]
        source = "task:sort"
        params = { min_len = 1, max_len = 4 }
        [run]
        steps = 3
        check_logprobs = true
    """, {"MILEHPC_FAULT": "scheduler:1@1"}, timeout=600)
    assert records[0]["dist/mpi_world_size"] == 2 and records[0]["dist/rollout_ranks"] == 1
    assert [r["step"] for r in records] == [0, 1, 2]
    # Every batch's sampled tokens agree with the trainer's peft forward of their own adapter, batch 2 (after the
    # restart) too: one engine batch served both adapters, and the restarted engine serves the synced ones.
    diffs = [r["train/logprob_diff_max"] for r in records]
    assert all(d < 1e-3 for d in diffs), diffs
    assert all(r["adapter/rev/samples"] == r["adapter/srt/samples"] == 4 for r in records), records
    # The scheduler died after batch 1; the engine was restarted once, in place, before batch 2.
    assert [r["rollout/engine_restarts"] for r in records] == [0.0, 0.0, 1.0], log[-3000:]
    assert "restarted in place with LoRA, loading adapter version 2" in log, log[-3000:]
    assert (tmp_path / "run" / "sglang-lora-base" / "config.json").is_file()  # the trainer's seeded base, on disk
    (adapters,) = {r["sync/bytes"] for r in records}
    full = records[0]["sync/full_model_bytes"]
    print(f"SGLang multi-LoRA sync: {adapters:.0f} bytes per sync (both adapters) vs {full:.0f} for the full model")
    assert 0 < adapters == sum(records[0][f"adapter/{a}/sync_bytes"] for a in ("rev", "srt")) < full / 2
    from milehpc.samples.dumps import read_rollouts

    # Every batch came from the adapters of the step before it (version 0 = after the LoRA warm-up); batch 2 from
    # version 2, loaded into the restarted engine.
    assert [{s.weight_version for s in read_rollouts(tmp_path / "run", k)[0]} for k in range(3)] == [{0}, {1}, {2}]
