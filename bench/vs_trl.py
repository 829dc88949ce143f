"""milehpc vs Hugging Face TRL's GRPOTrainer on the CPU demo's problem, side by side in one run.

One shared starting policy: the demo's SFT warm-up (examples/cpu-demo.toml, RL lr 0 for its single step), exported
as an HF folder with the toy tokenizer (``milehpc export``). From it, per seed: TRL's ``GRPOTrainer`` (one process),
then ``milehpc run --site local`` with ``model.path`` = that folder, for the sync and the one_step_off loops. Same
task prompts (task:reverse), 16 prompts x 8 samples, temperature 1.0, 8 new tokens, lr 1e-4, ppo-clip,
token-mean ("dapo" in TRL), no KL, milehpc's own toy_match reward; each run stops at a mean reward of 0.8 over the
last 10 steps. Prompts: both tools walk milehpc's own prompt stream of the demo's task with ``data.seed`` = the
seed, in the same order (TRL's dataset is that stream's first prompts, unshuffled: step k gets prompts 16k..16k+15
in both). milehpc runs the demo's algorithm table as shipped, which includes its truncated importance weights
(``off_policy_correction = "tis"``): the one-step-off loop trains on the previous weights' samples, and uncorrected
that lag cost ~40% more steps (see the README's Benchmarks section). Printed per tool/mode: steps to 0.8, RL wall
seconds to 0.8, s/step, generated tokens/s (over the generation time), peak RSS of the process tree (summed over
its processes, so pages the ranks share, such as libtorch's code, count once per rank) and peak PSS (each shared
page split among the processes that map it: the tree's memory counted once). The JSON has each process's own peak
RSS too. Last line: one JSON object with
``ratio`` = milehpc time-to-target (best loop) / TRL's (median over seeds) and the per-mode figures.

TRL runs in its own virtual environment, installed the way a TRL user installs it (``--trl-env``, default
``~/.cache/milehpc/bench/trl-1.16.0``, made on first use): ``pip install torch==2.13.0`` first (the CPU build:
on this machine pip's find-links hold it; elsewhere point pip at PyTorch's CPU wheels, e.g. with PIP_INDEX_URL),
then ``pip install trl==1.16.0``, which resolves transformers, accelerate and datasets itself (transformers 5.25.0
when this was written, not milehpc's pin). The TRL process imports nothing of milehpc but its reward
(``milehpc.data.tasks``, standard library only); its prompts come from milehpc's stream as a JSON file. Both tools'
versions are printed. TRL's settings are the fastest a TRL user would choose on this CPU: fp32 (``bf16=False``:
at this model size a step is bound by per-op overhead, not by matmuls, so autocast's casts cost more than bf16
saves: the demo model's forward + backward on a 128 x 19 batch took ~20% more CPU time in bf16 than in fp32,
one thread, on the 2-core AVX512-BF16 machine), no gradient checkpointing (it recomputes activations to save memory that is not
short here), ``torch_compile`` off (compiling takes longer than the whole run), the HF ``generate`` path (vLLM
needs its own server), all cores (``--trl-threads 2``: one process, so both cores go to its intra-op threads),
logging every step (the stopping rule reads each step's reward).

    .venv/bin/python bench/vs_trl.py [--seeds 3] [--max-steps 1500] [--repo .] [--trl-env DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGET = 0.8
LOOPS = ("sync", "one_step_off")
TRL_VERSION = "1.16.0"
TORCH_SPEC = "torch==2.13.0"  # installed before TRL: the CPU build, which TRL's own resolution would not pick


def find_repo(arg: str | None) -> Path:
    """The milehpc checkout: --repo, else the cwd or a parent of this file that holds examples/cpu-demo.toml."""
    candidates = [Path(arg)] if arg else [Path.cwd(), *Path(__file__).resolve().parents]
    for c in candidates:
        if (c / "examples" / "cpu-demo.toml").is_file():
            return c.resolve()
    sys.exit(f"vs_trl: expected a milehpc checkout (examples/cpu-demo.toml) at {arg or 'the cwd'}; pass --repo")


class PeakRSS:
    """Peaks of the summed RSS and of the summed PSS of a process and all its descendants, and of each process's
    own RSS. RSS is sampled every 0.1 s (``/proc/PID/statm``: cheap); PSS (``smaps_rollup``, a walk of the process's
    page tables under its memory-map lock, which can stall its allocations) only when the summed RSS reaches a new
    peak, at most once a second."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root, self.peak, self.peak_pss, self._stop = psutil.Process(pid), 0, 0, threading.Event()
        self.each: dict[int, tuple[str, int]] = {}  # pid -> (what it runs, peak RSS)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        last_pss = 0.0
        while not self._stop.wait(0.1):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            cmds = {}
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    cmds[p.pid] = p.cmdline()
            live = []
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # a rank that ended meanwhile
                    if p.pid in cmds and cmds[p.pid] == cmds.get(p.ppid()):
                        # forked, not yet exec'd (a rank runs `uname -p` when h5py is first imported): its pages
                        # are its parent's, RSS would count them twice
                        continue
                    rss = p.memory_info().rss
                    total += rss
                    live.append(p)
                    name, peak = self.each.get(p.pid) or (_role(p), 0)
                    self.each[p.pid] = (name, max(peak, rss))
            if total > self.peak and time.monotonic() - last_pss >= 1.0:
                last_pss = time.monotonic()
                pss = 0
                for p in live:
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        pss += p.memory_full_info().pss
                self.peak_pss = max(self.peak_pss, pss)
            self.peak = max(self.peak, total)

    def stop(self) -> dict[str, Any]:
        """``{"rss": MiB, "pss": MiB, "each": {role: MiB}}``: the tree's peaks and each process's."""
        self._stop.set()
        self._thread.join()
        each: dict[str, float] = {}
        for name, peak in self.each.values():
            key = name if name not in each else f"{name}#{sum(k.startswith(name) for k in each)}"
            each[key] = round(peak / 2**20, 1)
        return {"rss": self.peak / 2**20, "pss": self.peak_pss / 2**20, "each": each}


def _role(p: Any) -> str:
    """What a process of the tree is: the CLI, the job script, the launcher, a rank, or the TRL worker."""
    cmd = " ".join(p.cmdline())
    for needle, role in (("--trl-worker", "trl"), ("prterun", "mpirun"), ("mpirun", "mpirun"), ("prted", "prted"),
                         ("milehpc launch", "rank"), ("job.sbatch", "job-script"), ("milehpc run", "cli"),
                         ("milehpc export", "cli")):
        if cmd.startswith(needle) or f"/{needle}" in cmd or f" {needle}" in cmd:  # the program, not an argument
            return role
    return p.name()


def run_tree(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run ``cmd`` to the end (output in ``log``); returns its tree's memory peaks (:meth:`PeakRSS.stop`)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        rss = PeakRSS(proc.pid)
        rc = proc.wait()
    peak = rss.stop()
    if rc:
        sys.exit(f"vs_trl: {' '.join(cmd[:3])} failed (exit {rc}):\n{log.read_text()[-3000:]}")
    return peak


def milehpc_bin() -> str:
    return str(Path(sys.executable).with_name("milehpc"))


def run_demo(repo: Path, overrides: list[str], run_dir: Path, log: Path) -> dict[str, Any]:
    """``milehpc run examples/cpu-demo.toml --site local`` with ``--set`` overrides; returns its memory peaks."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    # Threads per rank are the site's choice (site-configs/local.toml): the benchmark runs what a user gets.
    env = {**os.environ, "MILEHPC_PROGRESS": "plain"}
    return run_tree([milehpc_bin(), "run", str(repo / "examples" / "cpu-demo.toml"), "--site", "local", *sets,
                     "--run-dir", str(run_dir)], env, log)


def build_policy(repo: Path, work: Path) -> Path:
    """The demo's warm-up once, exported as an HF folder: one RL step at lr 0 leaves the warmed-up weights as
    they are, and the end-of-run checkpoint is what ``milehpc export`` reads."""
    run_demo(repo, ["trainer.lr=0.0", "run.steps=1", 'run.loop="sync"', "run.dump_rollouts=false"],
             work / "warmup", work / "warmup.log")
    out = work / "policy"
    run_tree([milehpc_bin(), "export", str(work / "warmup"), "-o", str(out)], {**os.environ}, work / "export.log")
    return out


def target_window() -> int:
    """The window of milehpc's own run.target_reward, so both tools stop by the same rule (milehpc's side only:
    the TRL process gets it as an argument)."""
    from milehpc.runtime.loop.schedule import TARGET_WINDOW

    return TARGET_WINDOW


def window_hit(rewards: list[float], window: int) -> int | None:
    """1-based step at which the mean of the last ``window`` rewards first reaches TARGET."""
    for i in range(window, len(rewards) + 1):
        if sum(rewards[i - window:i]) / window >= TARGET:
            return i
    return None


def trl_python(env_dir: Path) -> Path:
    """The interpreter of TRL's own environment, made at ``env_dir`` unless it already holds TRL_VERSION."""
    python = env_dir / "bin" / "python"
    probe = "import importlib.metadata as m; print(m.version('trl'))"
    if python.is_file():
        have = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        if have.returncode == 0 and have.stdout.strip() == TRL_VERSION:
            return python
    print(f"making TRL's environment in {env_dir} (once): {TORCH_SPEC}, then trl=={TRL_VERSION}", flush=True)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    log = env_dir.parent / f"{env_dir.name}.install.log"
    with log.open("w") as out:
        for cmd in ([sys.executable, "-m", "venv", "--clear", str(env_dir)],
                    [str(python), "-m", "pip", "install", TORCH_SPEC],
                    [str(python), "-m", "pip", "install", f"trl=={TRL_VERSION}"]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"vs_trl: {' '.join(cmd[2:])} failed; see {log}")
    return python


def versions(python: str, packages: tuple[str, ...]) -> dict[str, str | None]:
    """The installed versions of ``packages`` in the environment of ``python``."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(p):\n    try:\n        return m.version(p)\n    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({p: v(p) for p in sys.argv[1:]}))")
    out = subprocess.run([python, "-c", code, *packages], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_milehpc(repo: Path, policy: Path, loop: str, seed: int, args: argparse.Namespace, work: Path) -> dict:
    name = f"milehpc-{loop}-s{seed}"
    mem = run_demo(repo, [f"model.path={json.dumps(str(policy))}", "trainer.sft_warmup_steps=0",
                          f"run.loop={json.dumps(loop)}", f"run.seed={seed}", f"data.seed={seed}", f"run.steps={args.max_steps}",
                          f"run.target_reward={TARGET}", "run.dump_rollouts=false"], work / name, work / f"{name}.log")
    recs = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "rollout/reward_mean" in r]
    # RL starts where the first step started: its end time less its own duration.
    start = recs[0]["time"] - recs[0].get("time/step", 0.0)
    hit = window_hit([r["rollout/reward_mean"] for r in recs], target_window())
    end = recs[(hit or len(recs)) - 1]["time"]
    gen_tokens = sum(r.get("rollout/gen_tokens", 0.0) for r in recs)
    gen_s = sum(r.get("time/gen", 0.0) for r in recs)
    steady = recs[5:] or recs  # the first steps pay for warm-up (allocations, the first weight sync)
    keys = {k for r in steady for k in r if k.startswith("time/") and k != "time/elapsed"}
    phases = {k: statistics.median(r[k] for r in steady if k in r) for k in sorted(keys)}
    return {"steps": hit, "seconds": end - start if hit else None, "s_per_step": (recs[-1]["time"] - start) / len(recs),
            "tokens_per_s": gen_tokens / gen_s if gen_s else None, **memory(mem),
            "final_reward": recs[-1]["rollout/reward_mean"], "phases": phases}


def run_trl(python: Path, policy: Path, seed: int, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"trl-s{seed}.json"
    # milehpc's prompt stream, unshuffled in TRL: TRL's step k sees milehpc's step k prompts.
    prompts = work / f"prompts-s{seed}.json"
    prompts.write_text(json.dumps([{"prompt": p.text, "label": p.label}
                                   for p in demo_prompts(find_repo(args.repo), seed, args.max_steps)]))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.trl_threads)}
    cmd = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(out), "--policy", str(policy),
           "--prompts", str(prompts), "--window", str(target_window()), "--seed", str(seed),
           "--max-steps", str(args.max_steps), "--trl-threads", str(args.trl_threads),
           "--repo", str(find_repo(args.repo))]
    mem = run_tree(cmd, env, work / f"trl-s{seed}.log")
    return {**json.loads(out.read_text()), **memory(mem)}


def memory(mem: dict[str, Any]) -> dict[str, Any]:
    return {"peak_rss_mib": mem["rss"], "peak_pss_mib": mem["pss"], "rss_by_process_mib": mem["each"]}


def demo_prompts(repo: Path, seed: int, steps: int) -> list[Any]:
    """The prompts milehpc's rollout side draws in its first ``steps`` steps with ``data.seed`` = ``seed``, in
    order: the demo's own prompt source (one engine: step k takes stream positions 16k..16k+15)."""
    from milehpc.config.load import load_job
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer

    job = load_job(repo / "examples" / "cpu-demo.toml", [f"data.seed={seed}"])
    source = build_source(job.data, build_tokenizer(job.model.tokenizer))
    return source.take(job.rollout.prompts_per_step * steps)


def trl_worker(args: argparse.Namespace) -> None:
    """Inside the TRL process (TRL's own environment): GRPOTrainer on the same task, reward and hyperparameters;
    writes its figures."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(find_repo(args.repo)))  # for milehpc's reward alone (standard library only)
    from milehpc.data.tasks import toy_match

    torch.set_num_threads(args.trl_threads)
    data = Dataset.from_list(json.loads(Path(args.prompts).read_text()))  # unshuffled below

    def reward(prompts: list[str], completions: list[str], label: list[str], **_: Any) -> list[float]:
        # milehpc's own reward on a duck-typed sample (response_text, label).
        return [toy_match(argparse.Namespace(response_text=c, label=lab)) for c, lab in zip(completions, label, strict=True)]

    rewards: list[float] = []
    lengths: list[float] = []
    gen_times: list[float] = []
    clock: dict[str, float] = {}

    class Stop(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock["start"] = time.perf_counter()

        def on_log(self, _args: Any, state: Any, control: Any, logs: dict | None = None, **k: Any) -> None:
            if not logs or "reward" not in logs:
                return
            rewards.append(logs["reward"])
            lengths.append(logs.get("completions/mean_length", 0.0))
            clock["last"] = time.perf_counter()
            if window_hit(rewards, args.window) and "hit" not in clock:
                clock["hit"] = clock["last"]
                control.should_training_stop = True

    cfg = GRPOConfig(output_dir=str(Path(args.trl_worker).parent / f"trl-out-s{args.seed}"), seed=args.seed,
                     use_cpu=True, max_steps=args.max_steps, learning_rate=1e-4, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=128,
                     gradient_accumulation_steps=1, num_generations=8, max_completion_length=8, temperature=1.0,
                     beta=0.0, epsilon=0.2, loss_type="dapo", num_iterations=1, logging_steps=1, shuffle_dataset=False,
                     report_to="none", save_strategy="no", bf16=False, gradient_checkpointing=False, disable_tqdm=True, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(str(args.policy), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(args.policy))
    generate = model.generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        # TRL logs its generation time only to W&B/MLflow/Trackio: time model.generate here instead.
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_times.append(time.perf_counter() - t)

    model.generate = timed_generate
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Stop()])
    trainer.train()
    steps = window_hit(rewards, args.window)
    total = clock["last"] - clock["start"]
    gen_s = sum(gen_times)
    tokens = sum(128 * x for x in lengths)
    Path(args.trl_worker).write_text(json.dumps({
        "steps": steps, "seconds": clock["hit"] - clock["start"] if steps else None,
        "s_per_step": total / len(rewards), "tokens_per_s": tokens / gen_s if gen_s else None,
        "final_reward": rewards[-1], "first_reward": rewards[0], "torch_threads": torch.get_num_threads()}))


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=1500, help="a run that has not reached 0.8 by then stops")
    ap.add_argument("--repo", help="the milehpc checkout (default: the cwd or a parent of this file)")
    ap.add_argument("--trl-threads", type=int, default=2)
    ap.add_argument("--loops", default=",".join(LOOPS), help="milehpc loops to run, comma-separated")
    ap.add_argument("--work", help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--trl-env", default=str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                             / "milehpc" / "bench" / f"trl-{TRL_VERSION}"),
                    help="TRL's own virtual environment (made there on first use)")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--window", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    repo = find_repo(args.repo)
    python = trl_python(Path(args.trl_env))
    tool_versions = {"trl": versions(str(python), ("trl", "transformers", "torch", "accelerate", "datasets")),
                     "milehpc": versions(sys.executable, ("milehpc", "transformers", "torch"))}
    for tool, v in tool_versions.items():
        print(f"{tool}: " + ", ".join(f"{k} {x}" for k, x in v.items()), flush=True)
    print(f"TRL settings (see this file's docstring for why): fp32, no gradient checkpointing, no torch.compile, "
          f"transformers generate, {args.trl_threads} torch threads, logging every step", flush=True)
    loops = [x for x in args.loops.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="milehpc-vs-trl-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        policy = build_policy(repo, work)
        print(f"starting policy (SFT warm-up, exported) in {time.perf_counter() - t0:.1f}s", flush=True)
        results: dict[str, list[dict]] = {"trl": [], **{f"milehpc-{lp}": [] for lp in loops}}
        for seed in range(args.seeds):
            results["trl"].append(run_trl(python, policy, seed, args, work))
            for lp in loops:
                results[f"milehpc-{lp}"].append(run_milehpc(repo, policy, lp, seed, args, work))
            for mode, runs in results.items():
                r = runs[-1]
                print(f"seed {seed} {mode:<22} steps {fmt(r['steps'], 'd')}  {fmt(r['seconds'], '.1f')}s  "
                      f"final reward {r['final_reward']:.2f}", flush=True)
    print(f"\n{'tool/mode':<22}{'steps to 0.8':>13}{'RL s to 0.8':>13}{'s/step':>9}{'gen tok/s':>11}{'peak RSS':>11}"
          f"{'peak PSS':>11}")
    summary: dict[str, dict[str, Any]] = {}
    for mode, runs in results.items():
        s = {k: median([r[k] for r in runs]) for k in ("steps", "seconds", "s_per_step", "tokens_per_s",
                                                       "peak_rss_mib", "peak_pss_mib")}
        s["rss_by_process_mib"] = runs[-1]["rss_by_process_mib"]
        s["reached"] = sum(r["steps"] is not None for r in runs)
        if mode != "trl":
            s["phases_s"] = {k: round(v, 4) for k, v in runs[0]["phases"].items()}
        summary[mode] = {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}
        print(f"{mode:<22}{fmt(s['steps'], '.0f'):>13}{fmt(s['seconds'], '.1f'):>13}{fmt(s['s_per_step'], '.3f'):>9}"
              f"{fmt(s['tokens_per_s'], '.0f'):>11}{fmt(s['peak_rss_mib'], '.0f'):>8}MiB{fmt(s['peak_pss_mib'], '.0f'):>8}MiB")
    trl_t = summary["trl"]["seconds"]
    best = {m: summary[m]["seconds"] for m in summary if m != "trl" and summary[m]["seconds"] is not None}
    ratio = {m: round(t / trl_t, 3) for m, t in best.items()} if trl_t else {}
    # Memory: each mode's peak over TRL's (issue 15's goal: <= 1.5), summed RSS and PSS.
    mem = {f"{m}/{k}": round(summary[m][f"peak_{k}_mib"] / summary["trl"][f"peak_{k}_mib"], 3)
           for m in summary if m != "trl" for k in ("rss", "pss")}
    result = {"ratio": min(ratio.values()) if ratio else None, "ratio_by_mode": ratio, "goal": 0.8,
              "memory_ratio_vs_trl": mem, "memory_goal": 1.5, "versions": tool_versions,
              "seeds": args.seeds, "target_reward": TARGET, "modes": summary}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
