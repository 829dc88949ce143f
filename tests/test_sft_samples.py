"""The supervised warm-up's samples (milehpc/runtime/loop/sft_samples.py): a multi-turn label trains the assistant
turns (through EOS) and masks the tool's text, tokenised as an agent episode records it; a text label is all
trained; a label the warm-up cannot render is a ConfigError naming data.label_key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from milehpc.data.source import Prompt
from milehpc.data.tokenizer import CharTokenizer, HFTokenizer
from milehpc.errors import ConfigError
from milehpc.rollout.agent_episode import ChatRenderer
from milehpc.runtime.loop.sft_samples import sft_sample

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "agent_calculator.py"
QUESTION = [{"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module")
def calc(tmp_path_factory):
    """The calculator example (its ChatML word tokenizer: no download) and that tokenizer."""
    spec = importlib.util.spec_from_file_location("agent_calculator_for_sft", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, HFTokenizer(module.build_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def chat_prompt(tok, label, raw=QUESTION) -> Prompt:
    text = ChatRenderer(tok).render(raw)
    return Prompt(ids=tok.encode(text), text=text, label=label, index=3, raw=raw)


@pytest.mark.quick
def test_a_multi_turn_label_trains_the_assistant_turns_and_masks_the_tool_text(calc) -> None:
    module, tok = calc
    label = [{"role": "assistant", "content": module.CALL}, {"role": "tool", "content": "7"},
             {"role": "assistant", "content": "7"}]
    prompt = chat_prompt(tok, label)
    s = sft_sample(tok, prompt)
    call, answer = tok.encode(module.CALL), tok.encode("7")
    glue = tok.encode("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    assert s.prompt_ids == prompt.ids and (s.group, s.index, s.label) == (3, 3, label)
    assert s.response_ids == [*call, tok.eos_id, *glue, *answer, tok.eos_id]
    assert s.loss_mask == [1] * (len(call) + 1) + [0] * len(glue) + [1] * (len(answer) + 1)
    trained = [i for i, m in zip(s.response_ids, s.loss_mask, strict=True) if m]
    masked = [i for i, m in zip(s.response_ids, s.loss_mask, strict=True) if not m]
    assert tok.tok.decode(trained) == module.CALL + "<|im_end|>" + "7<|im_end|>"
    assert "7" in tok.tok.decode(masked)  # the tool's result: in the sample, not trained on
    # The masked ids are what an agent episode appends after a reply that ended with EOS and a tool message.
    assert masked == ChatRenderer(tok).extension([{"role": "tool", "content": "7"}], None, ended_with_eos=True)


@pytest.mark.quick
def test_a_text_label_is_all_trained(calc) -> None:
    _, tok = calc
    s = sft_sample(tok, chat_prompt(tok, 7))
    assert s.response_ids == [*tok.encode("7"), tok.eos_id] and s.loss_mask == [1, 1]


@pytest.mark.quick
@pytest.mark.parametrize("case", ["ends with the tool", "no chat template", "text prompt", "not messages"])
def test_a_label_the_warm_up_cannot_render_names_the_label_key(calc, case: str) -> None:
    module, tok = calc
    call = {"role": "assistant", "content": module.CALL}
    tool = {"role": "tool", "content": "7"}
    if case == "ends with the tool":
        prompt = chat_prompt(tok, [call, tool])
    elif case == "no chat template":
        tok = CharTokenizer()
        prompt = Prompt(ids=[tok.bos_id], text="3+4=", label=[call, tool, {"role": "assistant", "content": "7"}],
                        index=0, raw=QUESTION)
    elif case == "text prompt":
        prompt = Prompt(ids=tok.encode("3+4="), text="3+4=", label=[call], index=0, raw="3+4=")
    else:
        prompt = chat_prompt(tok, ["7"])
    with pytest.raises(ConfigError) as err:
        sft_sample(tok, prompt, file="prompts.jsonl", field="data.label_key")
    assert err.value.field == "data.label_key" and "prompts.jsonl: data.label_key: " in str(err.value)
