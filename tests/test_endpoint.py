"""The OpenAI-compatible endpoint of a rollout rank (milehpc.rollout.endpoint): served by the real reference engine
over a tiny Qwen2-shaped model and a real HF tokenizer with a ChatML template; called by a second process (plain
HTTP, as another user on the node would) and by the real openai client.

Also the pure parts: the Qwen2.5 tool-call parser and the token-in/token-out recording of an episode."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_tokenizer import build_tokenizer_folder

from milehpc.rollout.agent_episode import ChatRenderer, Divergence, Episode
from milehpc.rollout.endpoint_auth import TOKEN_FILE, job_token
from milehpc.rollout.tool_calls import parse_qwen25
from milehpc.samples import Sample, Status


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from milehpc.data.tokenizer import HFTokenizer

    return HFTokenizer(str(build_tokenizer_folder(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def engine(tokenizer):
    from milehpc.config.job import ModelSpec
    from milehpc.models import build_model
    from milehpc.rollout.reference import ReferenceEngine

    spec = ModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                     max_position_embeddings=256)
    model = build_model(spec, tokenizer.vocab_size, seed=3, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
    return ReferenceEngine(model, tokenizer, seed=11)


@pytest.fixture(scope="module")
def endpoint(engine, tokenizer, tmp_path_factory):
    from milehpc.rollout.endpoint import Endpoint
    from milehpc.rollout.engine import SamplingParams

    run_dir = tmp_path_factory.mktemp("run")
    run_dir.chmod(0o700)
    ep = Endpoint(engine, tokenizer, token=job_token(run_dir), sampling=SamplingParams(max_new_tokens=6)).start()
    ep.run_dir = run_dir
    yield ep
    ep.close()


# ---- the parser ----
def test_qwen25_tool_calls_become_openai_calls_and_bad_blocks_are_counted() -> None:
    text = ('Let me add.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calc", "arguments": "{\\"expr\\": \\"1\\"}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "calc", "arguments": {oops}\n</tool_call>\n'
            '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>')
    turn = parse_qwen25(text, ["calc"], id_prefix="c")
    assert turn.content == "Let me add."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls] == [
        ("c_0", "calc", {"expr": "2+3"}), ("c_1", "calc", {"expr": "1"})]
    assert turn.malformed == 2  # the unparsable block and the tool that was not offered
    assert parse_qwen25("no call here", ["calc"]).tool_calls == []
    cut = parse_qwen25('<tool_call>\n{"name": "calc", "argu', ["calc"])  # cut off by max_tokens
    assert cut.tool_calls == [] and cut.malformed == 1 and cut.content is None


# ---- the token file ----
def test_the_job_token_is_created_once_private_and_refused_when_readable_by_others(tmp_path: Path) -> None:
    first = job_token(tmp_path)
    path = tmp_path / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert job_token(tmp_path) == first and len(first) >= 40  # every rank of the job reads the same secret
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="expected mode 0600"):
        job_token(tmp_path)


def test_a_run_without_a_run_directory_leaves_no_token_behind() -> None:
    """A local run (no run directory) keeps its token in a private temporary folder, removed when the process
    ends: a secret must not stay in /tmp after every run."""
    code = ("from milehpc.rollout.agent import _private_temp; from milehpc.rollout.endpoint_auth import job_token\n"
            "d = _private_temp('milehpc-endpoint-'); job_token(d); print(d, oct(d.stat().st_mode & 0o777))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    folder, mode = proc.stdout.split()
    assert mode == "0o700" and not Path(folder).exists(), proc.stdout


# ---- token-in/token-out recording ----
def _reply(tokenizer, text: str, *, eos: bool = True) -> Sample:
    ids = tokenizer.encode(text) + ([tokenizer.eos_id] if eos else [])
    return Sample(prompt_ids=[], response_ids=ids, rollout_logprobs=[-0.5] * len(ids), loss_mask=[1] * len(ids))


def test_an_episode_keeps_the_engine_tokens_and_masks_the_tool_text(tokenizer) -> None:
    r = ChatRenderer(tokenizer)
    ep = Episode("e1")
    msgs = [{"role": "user", "content": "what is 2+3?"}]
    ids = ep.context(msgs, None, r)
    assert ids == tokenizer.encode(r.render(msgs))
    reply = _reply(tokenizer, "call calc")
    ep.record(reply, 4, {"role": "assistant", "content": "call calc"}, eos_id=tokenizer.eos_id)
    msgs2 = [*msgs, {"role": "assistant", "content": "call calc"}, {"role": "tool", "content": "5"}]
    ids2 = ep.context(msgs2, None, r)
    s = ep.sample
    # The history is the recorded tokens untouched, then the tool turn: the whole is what the template spells.
    assert ids2[:len(ids) + len(reply.response_ids)] == ids + reply.response_ids
    assert tokenizer.tok.decode(ids2) == r.render(msgs2)
    n_env = len(ids2) - len(ids) - len(reply.response_ids)
    assert s.loss_mask == [1] * len(reply.response_ids) + [0] * n_env
    assert s.rollout_logprobs[len(reply.response_ids):] == [0.0] * n_env
    ep.record(_reply(tokenizer, "5"), 5, {"role": "assistant", "content": "5"}, eos_id=tokenizer.eos_id)
    assert s.metadata["versions"] == [4, 5] and s.weight_version == 4 and ep.divergences == 0
    # Asking again with nothing added (the reply was not what the agent wanted) opens the next assistant turn: an
    # extension, not a divergence (seen with a real engine's reply whose tool call was malformed).
    msgs3 = [*msgs2, {"role": "assistant", "content": "5"}]
    ids3 = ep.context(msgs3, None, r)
    assert ep.divergences == 0 and tokenizer.tok.decode(ids3) == r.render(msgs3)


@pytest.mark.parametrize("mode", ["drop", "split"])
def test_an_edited_history_is_detected_and_counted(tokenizer, mode: str) -> None:
    r = ChatRenderer(tokenizer)
    ep = Episode("e2", on_divergence=mode)
    msgs = [{"role": "user", "content": "what is 2+3?"}]
    ep.context(msgs, None, r)
    ep.record(_reply(tokenizer, "5"), 0, {"role": "assistant", "content": "5"}, eos_id=tokenizer.eos_id)
    # The agent rewrites the model's answer before going on: the recorded tokens no longer spell its history.
    edited = [*msgs, {"role": "assistant", "content": "6"}, {"role": "user", "content": "sure?"}]
    if mode == "drop":
        with pytest.raises(Divergence):
            ep.context(edited, None, r)
        assert ep.dropped and ep.divergences == 1
        assert [s.status for s in ep.samples()] == [Status.FAILED]
    else:
        ids = ep.context(edited, None, r)
        assert ids == tokenizer.encode(r.render(edited)) and ep.divergences == 1
        ep.record(_reply(tokenizer, "yes"), 1, {"role": "assistant", "content": "yes"}, eos_id=tokenizer.eos_id)
        segs = ep.samples()
        assert len(segs) == 2 and all(s.status is Status.COMPLETED for s in segs)
        assert all(s.metadata["agent_divergences"] == 1 for s in segs)


# ---- the server ----
SECOND_PROCESS = textwrap.dedent("""
    import json, sys, urllib.request, urllib.error
    url, token_file = sys.argv[1], sys.argv[2]
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}).encode()
    def post(path, headers, data=body):
        req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)
    token = open(token_file).read().strip()
    out = {"none": post("/v1/chat/completions", {}),
           "wrong": post("/v1/chat/completions", {"Authorization": "Bearer " + token[:-1] + "x"}),
           "models_none": post("/v1/models", {}, data=None),
           "chat": post("/v1/chat/completions", {"Authorization": "Bearer " + token}),
           "text": post("/v1/completions", {"Authorization": "Bearer " + token},
                        json.dumps({"prompt": "hi", "max_tokens": 3}).encode())}
    msgs = [{"role": "user", "content": "hi"}]
    bad = {"n_text": {"n": "2"}, "n_huge": {"n": 100000}, "tools": {"tools": [{"name": "calc"}]},
           "top_p_0": {"top_p": 0}, "seed_text": {"seed": "s"}, "temperature_neg": {"temperature": -1}}
    for key, extra in bad.items():
        out["bad_" + key] = post("/v1/chat/completions", {"Authorization": "Bearer " + token},
                                 json.dumps({"model": "policy", "messages": msgs, **extra}).encode())
    print(json.dumps(out))
""")


def test_a_second_process_without_the_token_is_refused_and_with_it_is_served(endpoint, tokenizer) -> None:
    token_file = endpoint.run_dir / TOKEN_FILE
    env = {k: v for k, v in os.environ.items() if "TOKEN" not in k}
    with endpoint.serving():
        proc = subprocess.run([sys.executable, "-c", SECOND_PROCESS, endpoint.url, str(token_file)],
                              capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert endpoint.token not in proc.args  # the secret travels in a private file, not on a command line
    out = json.loads(proc.stdout)
    for key in ("none", "wrong", "models_none"):
        status, body = out[key]
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (key, out[key])
    status, chat = out["chat"]
    assert status == 200, chat
    choice = chat["choices"][0]
    ids = choice["milehpc"]["token_ids"]
    assert 1 <= len(ids) <= 6 and choice["message"]["content"] == tokenizer.decode(ids)
    assert len(choice["logprobs"]["content"]) == len(ids) and all(c["logprob"] <= 0 for c in choice["logprobs"]["content"])
    status, text = out["text"]
    assert status == 200 and 1 <= len(text["choices"][0]["milehpc"]["token_ids"]) <= 3
    # Malformed requests get 400 and a message naming the field, not a server error.
    for key in ("n_text", "n_huge", "tools", "top_p_0", "seed_text", "temperature_neg"):
        status, body = out["bad_" + key]
        field = key.split("_")[0]
        assert status == 400 and field in body["error"]["message"], (key, out["bad_" + key])


def test_between_rollouts_the_endpoint_does_not_generate(endpoint) -> None:
    import openai

    async def call() -> None:
        client = openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key=endpoint.token, max_retries=0)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])

    with pytest.raises(openai.APIStatusError) as err:
        asyncio.run(call())  # not inside serving(): the weights may be changing
    assert err.value.status_code == 503


# ---- the agent generator ----
async def two_turn_agent(client, sample):
    """A plain OpenAI-client agent: ask, hand the model a tool result, ask again."""
    messages = list(sample["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message, {"role": "tool", "content": "tool says 42"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return {"reward": 1.0, "last": second.choices[0].message.content}


async def editing_agent(client, sample):
    """Rewrites the model's first answer before asking again: its history no longer matches the tokens."""
    messages = list(sample["messages"])
    await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "go on"}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


async def slow_agent(client, sample):
    await client.chat.completions.create(model="policy", messages=list(sample["messages"]))
    await asyncio.sleep(30)
    return 1.0


def _prompts(k: int) -> list:
    from milehpc.data.source import Prompt

    return [Prompt(ids=[1], text=f"add {i}+1", label=str(i + 1), index=i, raw=f"add {i}+1") for i in range(k)]


@pytest.fixture
def agent_endpoint(endpoint, engine):
    from milehpc.rollout import agent

    agent.use_endpoint(engine, endpoint)  # the module's endpoint, so its batching can be counted
    endpoint.batcher.window_s = 30.0  # in-process agents: a batch is cut when every episode waits, never by time
    yield endpoint
    endpoint.batcher.window_s = 0.02
    agent._ENDPOINTS.pop(id(engine), None)


def test_agent_episodes_run_batched_and_are_recorded_token_in_token_out(agent_endpoint, engine, tokenizer) -> None:
    import torch

    from milehpc.rollout.agent import agent_generator
    from milehpc.rollout.engine import SamplingParams

    calls = agent_endpoint.batcher.calls
    out = agent_generator(engine, _prompts(3), SamplingParams(max_new_tokens=6, n=2), agent=two_turn_agent,
                          tokenizer=tokenizer)
    assert [s.group for s in out] == [0, 0, 1, 1, 2, 2]
    assert agent_endpoint.batcher.calls - calls == 2  # 6 episodes x 2 turns in two engine calls
    tool_ids = tokenizer.encode("tool says 42")
    for s in out:
        assert s.status is not Status.FAILED and s.reward == 1.0 and s.metadata["agent_calls"] == 2, s.metadata
        env = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m == 0]
        assert any(env[i:i + len(tool_ids)] == tool_ids for i in range(len(env))), "the tool text is masked"
        assert sum(s.loss_mask) == sum(1 for m in s.loss_mask if m) >= 2
        # The recorded logprobs are the policy's: a transformers forward of the same weights over the recorded
        # tokens agrees (fp32, 1 layer, hidden 32: rounding differences are ~1e-6; the bound is 1e-3).
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0].float()
        lps = torch.log_softmax(logits[len(s.prompt_ids) - 1:-1], -1).gather(
            -1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        diff = (lps[mask] - torch.tensor(s.rollout_logprobs)[mask]).abs().max().item()
        assert diff < 1e-3, diff
    assert not agent_endpoint.open and not agent_endpoint.episodes  # nothing outlives the rollout


def test_a_diverging_or_slow_episode_is_dropped_and_counted(agent_endpoint, engine, tokenizer) -> None:
    from milehpc.rollout.agent import agent_generator
    from milehpc.rollout.engine import SamplingParams

    sp = SamplingParams(max_new_tokens=4)
    edited = agent_generator(engine, _prompts(2), sp, agent=editing_agent, tokenizer=tokenizer)
    assert all(s.status is Status.FAILED for s in edited)
    assert all(s.metadata["agent_divergences"] == 1 and "diverged" in s.metadata["agent_error"] for s in edited)
    assert [s.metadata["agent_counts"]["divergences"] for s in edited] == [1, 1]  # -> rollout/agent/divergences
    assert all(s.metadata["agent_counts"]["dropped"] == 1 for s in edited)
    split = agent_generator(engine, _prompts(1), sp, agent=editing_agent, tokenizer=tokenizer, on_divergence="split")
    assert len(split) == 2 and all(s.status is not Status.FAILED for s in split)
    slow = agent_generator(engine, _prompts(1), sp, agent=slow_agent, tokenizer=tokenizer, episode_timeout_s=0.5)
    assert [s.status for s in slow] == [Status.FAILED] and "timeout" in slow[0].metadata["agent_error"]
    assert slow[0].metadata["agent_counts"]["timeouts"] == 1


def test_an_engines_endpoint_is_found_by_the_engine_and_goes_with_it(engine, tokenizer) -> None:
    """The endpoint is the engine's own (not whatever has its id: an id is reused once its object is freed), and it
    does not keep a freed engine alive: the engine's end closes it and removes the entry."""
    import gc
    import weakref

    from milehpc.rollout import agent
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.reference import ReferenceEngine

    other = ReferenceEngine(engine.model, tokenizer, seed=5)  # another rank's engine (the same weights: cheap)
    ep = agent.endpoint_for(other, tokenizer, SamplingParams(), run_dir=None)
    assert agent.endpoint_for(other, tokenizer, SamplingParams(), run_dir=None) is ep and ep.running
    key, gone = id(other), weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None, "the endpoint keeps its engine alive"
    assert not ep.running and key not in agent._ENDPOINTS


# ---- the job's listening sockets ----
def test_no_listening_socket_of_the_rank_is_usable_without_the_token(endpoint) -> None:
    import http.server
    import socket
    import threading

    from milehpc.comm.net import host_store
    from milehpc.rollout.endpoint_sockets import listeners, unprotected

    store, port = host_store("127.0.0.1", f"sockets-{os.getpid()}", 1, 30.0)  # the rendezvous a rank hosts
    mine = {(lst.address, lst.port) for lst in listeners([os.getpid()])}
    assert {("127.0.0.1", endpoint.port), ("127.0.0.1", port)} <= mine, mine
    # The scan sees an open server (the control), and nothing else of the rank's: the endpoint answers 401, the
    # TCPStore (which cannot check a token) listens on the job's interface only.
    open_server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=open_server.serve_forever, daemon=True).start()
    # ... and a socket on every interface that speaks no HTTP (Open MPI's TCP BTL): it hangs up at once, so the
    # probe costs no timeout.
    silent = socket.create_server(("0.0.0.0", 0))

    def hang_up() -> None:
        while True:
            try:
                silent.accept()[0].close()
            except OSError:  # closed below
                return

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        found = unprotected([os.getpid()])
        assert any(f":{open_server.server_port} answers HTTP" in p for p in found), found
        assert f"pid {os.getpid()}: 0.0.0.0:{silent.getsockname()[1]} (not HTTP: no token possible) listens on " \
               "every interface" in found, found
    finally:
        open_server.shutdown()
        open_server.server_close()
        silent.close()
    assert unprotected([os.getpid()]) == []
    store.set("still", "served")  # the probe did not break the store
    assert store.get("still") == b"served"


def test_the_unix_socket_endpoint_is_private_and_needs_the_token(engine, tokenizer, tmp_path: Path) -> None:
    import httpx

    from milehpc.rollout.endpoint import Endpoint
    from milehpc.rollout.engine import SamplingParams

    path = tmp_path / "endpoint.sock"
    ep = Endpoint(engine, tokenizer, token=job_token(tmp_path), sampling=SamplingParams(), unix_socket=path).start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), trust_env=False) as client:
            assert client.get("http://localhost/v1/models").status_code == 401
            ok = client.get("http://localhost/v1/models", headers={"Authorization": f"Bearer {ep.token}"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "policy"
    finally:
        ep.close()


@pytest.mark.parametrize(("params", "expected"), [
    ({}, "rollout.generator_params.agent: expected the agent to run"),
    ({"agent": "run"}, "rollout.generator_params.agent: expected 'package.module:function', got 'run'"),
    ({"agent": "m:run", "on_divergence": "keep"}, "rollout.generator_params.on_divergence: expected one of"),
])
def test_agent_params_are_checked_on_the_login_node(params: dict, expected: str) -> None:
    from milehpc.config.load import job_from_dict
    from milehpc.config.rules import check_job_rules
    from milehpc.errors import ConfigError

    job = job_from_dict({"name": "agent", "rollout": {"generator": "agent", "generator_params": params}})
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_job_rules(job, file="job.toml")
