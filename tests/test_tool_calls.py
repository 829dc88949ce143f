"""The tool-call parsers per model family (milehpc.rollout.tool_calls): each format's calls become OpenAI
``tool_calls``, the text before them the content, and every call that cannot be run is counted as malformed; the
family picks the parser unless ``tool_parser`` names one; an agent job without a known format, or whose agent
module cannot be imported, is refused on the login node in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milehpc.config.families import FAMILY_PARSERS, TOOL_PARSERS, parser_name
from milehpc.rollout.tool_calls import PARSERS

TOOLS = ["calc", "search"]


def calls(turn) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls]


@pytest.mark.parametrize(("parser", "text"), [
    ("qwen25", 'Let me.<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "search", "arguments": {"q": "a;b"}}\n</tool_call>'),
    ("llama3", 'Let me.<|python_tag|>{"name": "calc", "parameters": {"x": 1}}; '
               '{"name": "search", "parameters": {"q": "a;b"}}'),
    ("mistral", 'Let me.[TOOL_CALLS] [{"name": "calc", "arguments": {"x": 1}}, '
                '{"name": "search", "arguments": {"q": "a;b"}}]'),
    ("mistral", 'Let me.[TOOL_CALLS]calc[ARGS]{"x": 1}[TOOL_CALLS]search[ARGS]{"q": "a;b"}'),
    ("glm45", 'Let me.<tool_call>calc\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>'
              '<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>a;b</arg_value>\n</tool_call>'),
])
def test_each_format_gives_its_calls_and_content(parser: str, text: str) -> None:
    turn = PARSERS[parser](text, TOOLS, id_prefix="c")
    assert calls(turn) == [("calc", {"x": 1}), ("search", {"q": "a;b"})]
    assert turn.content == "Let me." and turn.malformed == 0
    assert [c["id"] for c in turn.tool_calls] == ["c_0", "c_1"]


def test_llama3_reads_a_whole_reply_object_and_leaves_plain_text_alone() -> None:
    turn = PARSERS["llama3"]('{"name": "calc", "parameters": {"x": 2}}', TOOLS)
    assert calls(turn) == [("calc", {"x": 2})] and turn.content is None
    plain = PARSERS["llama3"]("The answer is {1}.", TOOLS)
    assert plain.tool_calls == [] and plain.content == "The answer is {1}." and plain.malformed == 0


@pytest.mark.parametrize(("parser", "text", "good", "bad"), [
    # an unparsable block, a tool not offered, a call cut off by max_tokens
    ("qwen25", '<tool_call>{"name": calc}</tool_call><tool_call>{"name": "rm", "arguments": {}}</tool_call>'
               '<tool_call>{"name": "calc", "arguments": {}}</tool_call><tool_call>{"name": "ca', 1, 3),
    ("llama3", '<|python_tag|>{"name": "rm", "parameters": {}}; {"name": "calc", "parameters": {}}; {"name": "ca',
     1, 2),
    ("llama3", '{"parameters": {}}', 0, 1),  # no name
    ("mistral", '[TOOL_CALLS] [{"name": "calc", "arguments": {}}, {"name": "rm", "arguments": {}}, 3]', 1, 2),
    ("mistral", '[TOOL_CALLS] [{"name": "calc", "arguments": {}}', 0, 1),  # cut off
    ("mistral", '[TOOL_CALLS]calc[ARGS]{"x": [TOOL_CALLS]calc[ARGS]{}', 1, 1),
    ("glm45", '<tool_call>calc<arg_key>x</arg_key></tool_call><tool_call>rm</tool_call>'
              '<tool_call>calc</tool_call><tool_call>calc<arg_key>x', 1, 3),
])
def test_malformed_calls_are_counted_and_not_run(parser: str, text: str, good: int, bad: int) -> None:
    turn = PARSERS[parser](text, TOOLS)
    assert (len(turn.tool_calls), turn.malformed) == (good, bad), turn


def test_glm45_values_are_json_when_they_parse_else_strings() -> None:
    turn = PARSERS["glm45"]('<tool_call>calc\n<arg_key>n</arg_key><arg_value>[1, 2]</arg_value>\n'
                            '<arg_key>s</arg_key><arg_value>two words</arg_value></tool_call>', TOOLS)
    assert calls(turn) == [("calc", {"n": [1, 2], "s": "two words"})]


def test_the_family_picks_the_parser_and_the_option_overrides_it() -> None:
    from milehpc.config.families import FAMILIES, VISION_FAMILIES

    assert set(FAMILY_PARSERS) == set(FAMILIES) | set(VISION_FAMILIES)  # a new family must name its format
    assert set(PARSERS) == set(TOOL_PARSERS)  # the login check's names are the rollout's parsers
    assert [parser_name(None, t) for t in ("qwen3", "llama", "mixtral", "glm4")] == \
        ["qwen25", "llama3", "mistral", "glm45"]
    assert parser_name("none", "llama") == "none"
    with pytest.raises(ValueError, match="tool_parser"):
        parser_name(None, "gpt2")
    with pytest.raises(ValueError, match="expected a tool-call parser"):
        parser_name("hermes", "qwen2")


def test_the_login_node_refuses_an_agent_job_without_a_known_format_or_importable_agent(tmp_path: Path) -> None:
    """`milehpc plan` (what run/submit check first): one line, exit 2, before anything is submitted."""
    from click.testing import CliRunner

    from milehpc.cli import cli

    root = Path(__file__).resolve().parent
    (tmp_path / "login_agent.py").write_text("async def run(client, sample):\n    return 1.0\n")
    base = ("plan", str(root / "corpus" / "valid-job.toml"), "--site", "local", "--set", "rollout.generator='agent'",
            "--set", f"env.PYTHONPATH='{tmp_path}'", "--set", "model.arch='qwen3'")

    def plan(agent: str, *more: str):
        params = f"{{agent = '{agent}'{''.join(more)}}}"
        return CliRunner().invoke(cli, [*base, "--set", f"rollout.generator_params={params}"])

    assert plan("login_agent:run").exit_code == 0, plan("login_agent:run").output  # qwen3: its own parser
    res = plan("login_agent:missing")
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0, res.output
    assert "rollout.generator_params.agent: expected an importable module:function" in res.stderr, res.output
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (model / "tokenizer.json").write_text("{}")
    res = CliRunner().invoke(cli, [*base, "--set", f"model.path='{model}'", "--set",
                                   "rollout.generator_params={agent = 'login_agent:run'}"])
    assert res.exit_code == 2 and "rollout.generator_params.tool_parser" in res.stderr, res.output
