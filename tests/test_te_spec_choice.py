"""Fault 6 (issue 30): which layer spec the Megatron trainer builds on a GPU without transformer-engine (ROCm).

megatron-core 0.16.1 (installed here, without TE, as on ROCm) is real in these tests; where a test needs a GPU it
says so in its name: ``cuda`` is passed to :func:`te_spec_choice` as True, nothing else is faked."""

from __future__ import annotations

from typing import Any

import pytest

from milehpc.config.load import job_from_dict
from milehpc.errors import PluginError
from milehpc.train.megatron import model as mm


def _trainer(precision: str, **options: Any) -> Any:
    job = job_from_dict({
        "name": "te-spec", "model": {"arch": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                     "num_kv_heads": 2, "intermediate_size": 128, "dtype": "bfloat16"},
        "trainer": {"backend": "megatron", "precision": precision, "options": options}}, file="te-spec.toml")
    return job.trainer


def _megatron_have_te() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def test_megatron_without_te_fails_on_its_te_spec_as_the_issue_says() -> None:
    """The upstream fault itself, on the installed megatron-core: its TE spec needs TE (NameError without)."""
    if _megatron_have_te():
        pytest.skip("transformer-engine imports here: megatron-core's TE spec builds")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    with pytest.raises(NameError, match="TESpecProvider"):
        get_gpt_layer_with_transformer_engine_spec()


def test_bf16_with_cuda_faked_available_and_the_real_megatron_without_te_builds_the_local_spec() -> None:
    have_te = _megatron_have_te()
    te = mm.te_spec_choice(_trainer("bf16"), cuda=True, have_te=have_te)
    assert te is have_te
    arch = mm.arch_of(mm.hf_config_for(job_from_dict({
        "name": "a", "model": {"arch": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                               "num_kv_heads": 2, "intermediate_size": 128}}).model, 256))
    spec = mm.layer_spec(arch, te=te)  # the old choice (te=True on any GPU) raised NameError here
    if not have_te:  # megatron-core's own local modules: a separate input norm, a plain column-parallel QKV
        assert spec.submodules.self_attention.submodules.linear_qkv.__name__ == "ColumnParallelLinear"
        assert spec.submodules.input_layernorm.__name__ == "WrappedTorchNorm"


def test_fp8_or_te_asked_with_cuda_faked_available_and_no_te_is_one_line() -> None:
    for trainer, what in ((_trainer("fp8"), "trainer.precision = 'fp8'"),
                          (_trainer("bf16", transformer_engine=True), "trainer.options.transformer_engine = true")):
        with pytest.raises(PluginError) as err:
            mm.te_spec_choice(trainer, cuda=True, have_te=False)
        line = str(err.value)
        assert "\n" not in line and what in line and "'transformer-engine'" in line
        assert err.value.exit_code == 2


@pytest.mark.parametrize(("precision", "options", "cuda", "have_te", "want"), [
    ("bf16", {}, True, True, True),  # a CUDA node with TE: the TE spec, as before
    ("fp8", {}, True, True, True),
    ("fp32", {}, True, True, False),
    ("bf16", {"transformer_engine": False}, True, True, False),
    ("fp32", {"transformer_engine": True}, True, True, True),
    ("bf16", {}, False, False, False),  # CPU
    ("fp8", {}, False, False, False),
])
def test_te_spec_choice_table_with_cuda_and_te_given(precision: str, options: dict[str, Any], cuda: bool,
                                                     have_te: bool, want: bool) -> None:
    assert mm.te_spec_choice(_trainer(precision, **options), cuda=cuda, have_te=have_te) is want
