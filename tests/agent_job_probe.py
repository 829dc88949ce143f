"""The agent of tests/test_agent_mpi.py's job, imported by its rollout rank: examples/agent_calculator.py's ``run``
unchanged, plus, in the rank's first episode (every socket of the job is open then: the trainer's rendezvous and
gloo, this rank's endpoint, MPI's), the audit of the job's listening sockets (:mod:`milehpc.rollout.endpoint_sockets`)
and a tokenless request to the endpoint from a second process. What it saw goes to ``$AGENT_PROBE_OUT``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import agent_calculator

SECOND_PROCESS = """
import json, sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                             data=json.dumps({"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}).encode())
try:
    urllib.request.urlopen(req, timeout=30)
    print(200)
except urllib.error.HTTPError as e:
    print(e.code)
"""

_probed = False


def job_processes() -> list[int]:
    """The job's processes on this node: the launcher's children (every rank here) and theirs (engine children)."""
    import psutil

    parent = psutil.Process(os.getppid())
    return sorted({os.getpid(), *(p.pid for p in parent.children(recursive=True))})


async def probe(client: Any) -> dict[str, Any]:
    from milehpc.rollout.endpoint_sockets import listeners, unprotected

    pids = job_processes()
    # Off the endpoint's event loop: it must go on answering (the audit probes this rank's endpoint too).
    found = await asyncio.to_thread(listeners, pids)
    problems = await asyncio.to_thread(unprotected, pids)
    origin = str(client.base_url).split("/episodes/")[0]
    env = {k: v for k, v in os.environ.items() if "TOKEN" not in k}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SECOND_PROCESS, origin, env=env,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    import psutil

    return {"rank_pid": os.getpid(), "pids": pids, "names": [psutil.Process(p).name() for p in pids],
            "listeners": [[x.pid, x.address, x.port] for x in found], "problems": problems, "endpoint": origin,
            "tokenless_status": int(out.decode().strip() or 0)}


async def run(client: Any, sample: dict[str, Any]) -> dict[str, Any]:
    global _probed
    if not _probed:
        _probed = True
        seen = await probe(client)
        with open(os.environ["AGENT_PROBE_OUT"], "w") as f:
            json.dump(seen, f)
    return await agent_calculator.run(client, sample)
