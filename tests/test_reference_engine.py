"""The reference rollout engine: sampling controls, logprobs that match the trainer's, weights by name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from milehpc.config.job import JobSpec, ModelSpec
from milehpc.data.tasks import sort_task
from milehpc.data.tokenizer import CharTokenizer
from milehpc.models import build_model
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.reference import ReferenceEngine, filter_logits
from milehpc.samples import Status

TOK = CharTokenizer()
SPEC = ModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                 max_position_embeddings=64)


def engine(seed: int = 0, model_seed: int = 0) -> ReferenceEngine:
    return ReferenceEngine(build_model(SPEC, TOK.vocab_size, seed=model_seed), TOK, seed=seed)


def prompts(n: int, min_len: int = 2, max_len: int = 6) -> list[list[int]]:
    task = sort_task(min_len=min_len, max_len=max_len)
    return [TOK.encode_prompt(task[i]["prompt"]) for i in range(n)]


@contextmanager
def forward_batches(eng: ReferenceEngine) -> Iterator[list[tuple[int, int]]]:
    """(rows, tokens) of every forward call of the engine's model while inside."""
    seen: list[tuple[int, int]] = []
    hook = eng.model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                               with_kwargs=True)
    try:
        yield seen
    finally:
        hook.remove()


# Two runs whose decode batches differ in size may round a logit differently (the matmuls block by rows): fp32 eps
# x the longest reduction (intermediate_size) x a logit magnitude of a few units.
LP_TOL = torch.finfo(torch.float32).eps * SPEC.intermediate_size * 4

# Frequent digits as stop tokens: on the random models here, rows finish after 1, 2, 3... tokens.
EARLY_STOPS = TOK.encode("0123")


def test_n_samples_per_prompt_grouped_prompt_major() -> None:
    out = engine().generate(prompts(3), SamplingParams(n=4, max_new_tokens=5))
    assert len(out) == 12
    assert [s.group for s in out] == [0] * 4 + [1] * 4 + [2] * 4
    for s in out:
        assert 1 <= len(s.response_ids) <= 5
        assert len(s.rollout_logprobs) == len(s.loss_mask) == len(s.response_ids)
        assert all(lp <= 0 for lp in s.rollout_logprobs)
        if s.status is Status.COMPLETED:
            assert s.response_ids[-1] == TOK.eos_id and TOK.eos_id not in s.response_ids[:-1]
        else:
            assert s.status is Status.TRUNCATED and len(s.response_ids) == 5


def test_seeded_sampling_is_reproducible_and_varies() -> None:
    p = prompts(4)
    a = engine(seed=1).generate(p, SamplingParams(n=2, max_new_tokens=6))
    b = engine(seed=1).generate(p, SamplingParams(n=2, max_new_tokens=6))
    c = engine(seed=2).generate(p, SamplingParams(n=2, max_new_tokens=6))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_logprobs_match_a_teacher_forced_forward_with_mixed_prompt_lengths() -> None:
    """The engine's KV-cached, left-padded sampling and the trainer's padded full forward agree (fp32): with a
    prompt's samples sharing one prefill and finished rows leaving the decode batch."""
    from milehpc.train.torch_trainer import TorchTrainer

    job = JobSpec(name="t", model=SPEC)
    job.rollout.temperature = 0.7
    trainer = TorchTrainer(job, TOK)
    eng = engine(seed=3, model_seed=9)
    eng.update_weights(trainer.export_weights(), 1)
    with forward_batches(eng) as batches:
        out = eng.generate(prompts(8, 1, 7), SamplingParams(n=3, max_new_tokens=7, temperature=0.7,
                                                            stop_token_ids=EARLY_STOPS))
    assert len({len(s.prompt_ids) for s in out}) > 2
    assert batches[0][0] == 8 and min(rows for rows, _ in batches[1:]) < len(out)  # both paths ran
    recomputed = trainer.compute_logprobs(out)
    diff = max(abs(a - b) for s, lp in zip(out, recomputed, strict=True) for a, b in zip(s.rollout_logprobs, lp, strict=True))
    assert diff <= 1e-5


def test_one_prefill_per_distinct_context_and_only_unfinished_rows_decode() -> None:
    """The prefill runs each distinct context once (a prompt's n samples share it), no forward follows the last
    token, and once a quarter of the decode batch has finished those rows leave it."""
    p = prompts(3, 3, 3) + prompts(1, 5, 5) * 2  # 4 distinct prompts, one given twice
    eng = engine(seed=2)
    with forward_batches(eng) as batches:
        full = eng.generate(p, SamplingParams(n=4, max_new_tokens=6))
    assert batches[0] == (4, max(map(len, p)))
    assert len(batches) == max(len(s.response_ids) for s in full)  # prefill + one per token but the last
    with forward_batches(eng) as batches:
        out = eng.generate(p, SamplingParams(n=4, max_new_tokens=6, stop_token_ids=EARLY_STOPS))
    for k, (rows, tokens) in enumerate(batches[1:], 1):
        unfinished = sum(len(s.response_ids) > k for s in out)  # the rows that need token k + 1
        assert tokens == 1 and unfinished <= rows <= len(out)
        assert rows == unfinished or rows * 3 // 4 < unfinished, (k, rows, unfinished)
    assert batches[-1][0] < len(out)


def test_a_rows_samples_do_not_depend_on_which_other_rows_finished() -> None:
    """Rows are drawn from the same random stream however many rows have finished (and left the decode batch):
    each row of a run with stop tokens is the same seed's free run cut at its first stop token."""
    p = prompts(4)
    free = engine(seed=11).generate(p, SamplingParams(n=4, max_new_tokens=8))
    cut = engine(seed=11).generate(p, SamplingParams(n=4, max_new_tokens=8, stop_token_ids=EARLY_STOPS))
    assert sum(s.status is Status.COMPLETED for s in cut) > sum(s.status is Status.COMPLETED for s in free)
    for a, b in zip(free, cut, strict=True):
        n = len(b.response_ids)
        assert b.response_ids == a.response_ids[:n]
        assert b.rollout_logprobs == pytest.approx(a.rollout_logprobs[:n], abs=LP_TOL)


def test_greedy_equals_top_k_one_and_ignores_seed() -> None:
    p = prompts(4)
    greedy = engine(seed=1).generate(p, SamplingParams(n=1, max_new_tokens=6, temperature=0.0))
    topk = engine(seed=7).generate(p, SamplingParams(n=1, max_new_tokens=6, top_k=1))
    assert [s.response_ids for s in greedy] == [s.response_ids for s in topk]


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(logits, 2, 1.0)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p = filter_logits(logits, 0, 0.7)  # 0.5 + 0.3 reach 0.7: the rest goes
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, 0, 0.01)[0, 0])  # the top token always stays
    # Sampling never leaves the nucleus.
    eng = engine(seed=4)
    out = eng.generate(prompts(2), SamplingParams(n=8, max_new_tokens=4, top_k=3))
    assert out


def test_stop_token_ids_and_stop_strings() -> None:
    eng = engine(seed=5)
    free = eng.generate(prompts(2), SamplingParams(n=4, max_new_tokens=8))
    tok_id = free[0].response_ids[0]
    stopped = engine(seed=5).generate(prompts(2), SamplingParams(n=4, max_new_tokens=8, stop_token_ids=[tok_id]))
    assert stopped[0].response_ids == [tok_id] and stopped[0].status is Status.COMPLETED
    text = TOK.decode(free[1].response_ids[:2])
    if len(text) == 2:
        by_text = engine(seed=5).generate(prompts(2), SamplingParams(n=4, max_new_tokens=8, stop=[text]))
        assert by_text[1].response_text.endswith(text) and len(by_text[1].response_ids) <= 2


def test_update_weights_by_name_changes_outputs_and_version() -> None:
    a, b = engine(model_seed=0), engine(model_seed=1)
    p = prompts(3)
    sp = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    assert not all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True))
    b.update_weights(a.named_parameters(), version=5)
    assert b.weight_version() == 5
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True))
    assert [s.response_ids for s in a.generate(p, sp)] == [s.response_ids for s in b.generate(p, sp)]
    with pytest.raises(KeyError, match="no parameter named"):
        b.update_weights([("model.nope.weight", torch.zeros(1))], 6)


def test_continuing_partial_samples_appends_tokens() -> None:
    eng = engine(seed=6)
    out = eng.generate(prompts(2), SamplingParams(n=2, max_new_tokens=2))
    cut = [s for s in out if s.status is Status.TRUNCATED]
    before = {id(s): list(s.response_ids) for s in cut}
    eng.generate([], SamplingParams(n=1, max_new_tokens=3), samples=cut)
    for s in cut:
        assert s.response_ids[:2] == before[id(s)] and 3 <= len(s.response_ids) <= 5
        assert len(s.rollout_logprobs) == len(s.response_ids) == len(s.loss_mask)
        assert s.metadata["versions"] == [0, 0]


def test_engine_state_dict_restores_the_sampling_stream() -> None:
    eng = engine(seed=8)
    p = prompts(2)
    eng.generate(p, SamplingParams(n=2, max_new_tokens=3))
    state = eng.state_dict()
    want = [s.response_ids for s in eng.generate(p, SamplingParams(n=2, max_new_tokens=4))]
    other = engine(seed=99)
    other.load_state_dict(state)
    assert [s.response_ids for s in other.generate(p, SamplingParams(n=2, max_new_tokens=4))] == want
