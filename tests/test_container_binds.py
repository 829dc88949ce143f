"""Issue 32 items 1 and 2: the container sees every path the job reads or writes, and every model family loads from
a ``save_pretrained`` folder on the ranks.

One real ``milehpc run --site local`` launch (real mpirun, 1 rollout + 1 trainer rank) runs each rank inside an
Apptainer stand-in (tests/apptainer_standin/apptainer: `apptainer exec` mapped onto bubblewrap, showing the ranks
the image's read-only system and the rendered binds, nothing else of the host). The job's model, tokenizer, data,
checkpoint directory and reward file all live outside the run directory and outside the image. Its policy is a saved
Qwen2 folder with a saved tokenizer folder (the rank loads the tokenizer first: the order that broke the lean import),
and its reward loads every other family's saved folder on the rollout rank through the ranks' own loader.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from family_models import SHAPE, save_tiny
from family_probe_reward import PROBE_IDS
from tiny_tokenizer import build_tokenizer_folder

from milehpc.cli import cli
from milehpc.config.families import FAMILIES
from milehpc.config.load import job_from_dict
from milehpc.errors import ConfigError
from milehpc.render.binds import auto_binds, check_binds, job_paths

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "apptainer_standin"
VOCAB = 400  # the tiny tokenizer's size
POLICY = "qwen2"
# The two MoE families family_models.py has no tiny config for (their converters' tests build them the same way).
MOE_EXTRA = {"qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                           "shared_expert_intermediate_size": 48},
             "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}}


def _save_family(kind: str, folder: Path) -> None:
    if kind not in MOE_EXTRA:
        save_tiny(kind, folder, VOCAB, seed=3)
        return
    import transformers

    torch.manual_seed(3)
    cfg = getattr(transformers, FAMILIES[kind].config_class)(vocab_size=VOCAB, pad_token_id=0, eos_token_id=2,
                                                            bos_token_id=None, **SHAPE, **MOE_EXTRA[kind])
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))


def _image(path: Path) -> Path:
    """The stand-in's image: the host's system and this Python environment, read-only; not the tests, not /tmp."""
    python_home = Path(os.path.realpath(sys.executable)).parents[1]
    ro = ["/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", str(python_home), sys.prefix, str(ROOT / "milehpc"),
          str(ROOT / "plugins")]
    path.write_text(json.dumps({"ro": ro, "env": {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}}))
    return path


@pytest.fixture(scope="module")
def contained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one launch: every input outside the run directory, the ranks in the stand-in."""
    if not shutil.which("bwrap"):
        pytest.fail("bubblewrap (bwrap) is missing: scripts/setup-tests.sh installs it")
    base = tmp_path_factory.mktemp("contained")
    project = base / "project"
    # The policy's folder is bound because model.path names it; the other families' folders, which only the probe
    # reward reads (its params are opaque to milehpc), through the job's own container.binds.
    folders = {kind: project / ("models" if kind == POLICY else "families") / kind for kind in FAMILIES}
    for kind, folder in folders.items():
        _save_family(kind, folder)
    build_tokenizer_folder(project / "tokenizer")
    (project / "data").mkdir()
    shutil.copy(ROOT / "examples" / "data" / "gsm8k_style_train.jsonl", project / "data" / "train.jsonl")
    rewardlib = base / "rewardlib"
    rewardlib.mkdir()
    shutil.copy(ROOT / "tests" / "family_probe_reward.py", rewardlib)
    job = {
        "name": "contained",
        "model": {"path": str(folders[POLICY]), "tokenizer": str(project / "tokenizer")},
        "data": {"source": str(project / "data" / "train.jsonl")},
        "reward": {"name": "family_probe_reward:score",
                   "params": {"folders": {k: str(v) for k, v in folders.items() if k != POLICY}}},
        "rollout": {"prompts_per_step": 2, "n_samples": 4, "max_new_tokens": 4},
        "trainer": {"micro_batch_size": 8, "lr": 1e-2},
        "run": {"steps": 2, "loop": "sync", "dump_rollouts": False},
        "checkpoint": {"dir": str(base / "scratch" / "ckpt")},
        "container": {"image": str(_image(base / "image.json")), "binds": [str(project / "families")]},
        "env": {"PYTHONPATH": str(rewardlib)},
    }
    toml = base / "job.toml"
    toml.write_text(_toml(job))
    rdir = base / "run"
    # The login node imports the reward too (the input checks): the user's shell has the job's PYTHONPATH.
    env = {**os.environ, "PATH": f"{STANDIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "MILEHPC_PROGRESS": "plain", "PYTHONPATH": str(rewardlib)}
    proc = subprocess.run([str(Path(sys.executable).with_name("milehpc")), "run", str(toml), "--site", "local",
                           "--run-dir", str(rdir)], capture_output=True, text=True, timeout=300, env=env, cwd=base)
    return {"proc": proc, "base": base, "run_dir": rdir, "folders": folders, "toml": toml, "env": env}


def _toml(job: dict) -> str:
    """The job as TOML (tables of strings, numbers, booleans and string maps: all this test writes)."""
    def value(v: object) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    lines = [f"name = {json.dumps(job['name'])}"]
    for table, body in job.items():
        if isinstance(body, dict):
            lines.append(f"[{table}]")
            lines += [f"{json.dumps(k)} = {value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.mpi
@pytest.mark.slow
def test_a_job_whose_inputs_lie_outside_the_run_dir_runs_in_the_apptainer_standin(contained: dict) -> None:
    proc = contained["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (contained["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and records[0]["train/grad_norm"] > 0
    script = (contained["run_dir"] / "job.sbatch").read_text()
    binds = next(line for line in script.splitlines() if "apptainer exec" in line).split("--bind ")[1].split()[0]
    base = contained["base"]
    # Each input's directory once, the checkpoint dir (made before the job: a bind source must exist), the reward's
    # PYTHONPATH entry; nothing above them (the project root, the host's /tmp).
    assert binds.split(",") == [str(contained["run_dir"]), str(base / "project" / "families"),
                                str(base / "rewardlib"), str(base / "project" / "data"),
                                str(base / "project" / "tokenizer"), str(base / "scratch" / "ckpt"),
                                str(contained["folders"][POLICY])]
    assert list((base / "scratch" / "ckpt").glob("step-*")), "the checkpoint went to checkpoint.dir"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_every_family_loads_from_a_saved_folder_on_a_contained_rank(contained: dict, kind: str) -> None:
    import transformers

    assert contained["proc"].returncode == 0, contained["proc"].stderr[-3000:]
    folder = contained["folders"][kind]
    want_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    if kind == POLICY:
        # The policy: trained two steps on the ranks, exported, reloaded by transformers, weights moved.
        out = contained["base"] / "export"
        result = CliRunner().invoke(cli, ["export", str(contained["run_dir"]), "-o", str(out)])
        assert result.exit_code == 0, result.output
        got_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert got_model.config.model_type == kind
        moved = [n for n, p in got_model.state_dict().items() if not torch.equal(p, want_model.state_dict()[n])]
        assert moved, "the export holds the folder's initial weights, not the trained ones"
        return
    error = contained["run_dir"] / "family-probe-error.txt"
    assert not error.exists(), error.read_text()
    probe = torch.load(contained["run_dir"] / "family-logits.pt")
    assert probe[kind]["class"] == FAMILIES[kind].causal_lm
    with torch.no_grad():
        want = want_model(input_ids=torch.tensor(PROBE_IDS)).logits
    # Same weights, same float32 kernels in two processes: equal up to a reordered reduction of hidden_size terms.
    tol = SHAPE["hidden_size"] * torch.finfo(torch.float32).eps * float(want.abs().max())
    assert torch.allclose(probe[kind]["logits"], want, rtol=0, atol=tol)


@pytest.mark.mpi
@pytest.mark.slow
def test_the_standin_hides_what_is_not_bound(contained: dict) -> None:
    """The enforcement itself: the rendered binds minus the data's, and the rank's read of the data fails."""
    data = contained["base"] / "project" / "data" / "train.jsonl"
    read = ["python3", "-c", f"open({str(data)!r}).read(); print('read')"]
    image = str(contained["base"] / "image.json")
    seen = subprocess.run(["apptainer", "exec", "--cleanenv", "--bind", str(data.parent), image, *read],
                          capture_output=True, text=True, env=contained["env"], timeout=60)
    assert seen.returncode == 0 and "read" in seen.stdout, seen.stderr
    hidden = subprocess.run(["apptainer", "exec", "--cleanenv", "--bind", str(contained["base"] / "rewardlib"),
                             image, *read], capture_output=True, text=True, env=contained["env"], timeout=60)
    assert hidden.returncode != 0 and "FileNotFoundError" in hidden.stderr


# ---- login side: which paths, which binds, which refusals ------------------------------------------------------

def _job(**tables: dict) -> object:
    return job_from_dict({"name": "j", **tables})


def test_job_paths_names_every_path_a_rank_reads_or_writes(tmp_path: Path) -> None:
    (tmp_path / "lib" / "myreward").mkdir(parents=True)
    (tmp_path / "lib" / "myreward" / "__init__.py").write_text("def score(s):\n    return 0.0\n")
    job = _job(model={"path": "/p/model", "tokenizer": "/p/tok"},
               data={"source": "/p/data/train.parquet", "val_source": "/p/data/val.jsonl"},
               trainer={"options": {"teacher_path": "/p/teacher"},
                        "lora": {"adapters": {"a": {"source": "/q/a.jsonl", "val_source": "task:sort"},
                                                 "b": {"source": "task:sort"}}}},
               reward={"name": "myreward:score"}, checkpoint={"dir": "/scratch/ck"})
    env = {"PYTHONPATH": str(tmp_path / "lib"), "HF_HOME": "/scratch/hf", "TRITON_CACHE_DIR": "${HOME}/t",
           "OMP_NUM_THREADS": "1"}
    got = {p.field: (p.path, p.writable) for p in job_paths(job, "/runs/r", env)}
    assert got == {"run.run_dir": ("/runs/r", True), "model.path": ("/p/model", False),
                   "model.tokenizer": ("/p/tok", False), "data.source": ("/p/data/train.parquet", False),
                   "data.val_source": ("/p/data/val.jsonl", False),
                   "trainer.lora.adapters.a.source": ("/q/a.jsonl", False),
                   "trainer.options.teacher_path": ("/p/teacher", False), "checkpoint.dir": ("/scratch/ck", True),
                   "reward.name": (str(tmp_path / "lib"), False), "env.HF_HOME": ("/scratch/hf", True)}


def test_job_paths_names_the_reward_models_folders_combines_parts_included(tmp_path: Path) -> None:
    """A reward model or judge loads from a host folder on the rollout ranks: unbound, a contained rank fails to
    find it after the queue. So does a module:function part of ``combine``."""
    (tmp_path / "lib" / "partreward").mkdir(parents=True)
    (tmp_path / "lib" / "partreward" / "__init__.py").write_text("def score(s):\n    return 0.0\n")
    job = _job(reward={"name": "combine", "params": {"rewards": [
        {"name": "format"}, {"name": "partreward:score"},
        {"name": "judge", "gate": "format", "params": {"path": "/m/judge", "tokenizer": "/m/judge-tok"}}]},
        "by_source": {"web": {"name": "reward_model", "params": {"path": "/m/rm"}}}})
    got = {p.field: p.path for p in job_paths(job, "/runs/r", {"PYTHONPATH": str(tmp_path / "lib")})}
    assert {k: v for k, v in got.items() if k.startswith("reward.")} == {
        "reward.params.rewards[1].name": str(tmp_path / "lib"),
        "reward.params.rewards[2].params.path": "/m/judge", "reward.params.rewards[2].params.tokenizer": "/m/judge-tok",
        "reward.by_source.web.params.path": "/m/rm"}, got


def test_auto_binds_bind_each_directory_once_and_nothing_already_bound(tmp_path: Path) -> None:
    for d in ("proj/models/m", "proj/data", "site/shared/tok", "out"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "proj" / "data" / "train.jsonl").write_text("{}\n")
    job = _job(model={"path": str(tmp_path / "proj/models/m"), "tokenizer": str(tmp_path / "site/shared/tok")},
               data={"source": str(tmp_path / "proj/data/train.jsonl")},
               checkpoint={"dir": str(tmp_path / "out/ck/new")})
    paths = job_paths(job, str(tmp_path / "proj"), {})
    # The run dir holds the model and the data: nothing more for them; the site binds the shared area.
    assert auto_binds(paths, [str(tmp_path / "proj"), str(tmp_path / "site")]) == [str(tmp_path / "out/ck/new")]
    binds = [str(tmp_path / "proj"), str(tmp_path / "site"), str(tmp_path / "out")]
    check_binds(paths, binds)  # all covered
    with pytest.raises(ConfigError, match="checkpoint.dir") as err:
        check_binds(paths, binds[:2])
    assert "not bound into the container" in str(err.value)
    with pytest.raises(ConfigError, match="model.tokenizer") as err:
        check_binds(paths, binds, allowed=[str(tmp_path / "proj"), str(tmp_path / "out")], site="s")
    assert "the site s lets a container bind" in str(err.value)


def _render(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    (tmp_path / "image.sif").write_text("")
    job = tmp_path / "job.toml"
    job.write_text(f'name = "j"\n[data]\nsource = "{tmp_path}/data/train.jsonl"\n[reward]\nname = "math_answer"\n'
                   f'[container]\nimage = "{tmp_path}/image.sif"\n')
    return subprocess.run([str(Path(sys.executable).with_name("milehpc")), "render", str(job), "--site", "local",
                           "--run-dir", str(tmp_path / "run"), *sets], capture_output=True, text=True, timeout=60)


def test_render_binds_the_data_and_refuses_the_same_job_with_its_bind_removed(tmp_path: Path) -> None:
    ok = _render(tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert f"--bind {tmp_path}/run,{tmp_path}/data " in ok.stdout
    removed = _render(tmp_path, "--set", "container.auto_binds=false")
    assert removed.returncode == 2 and removed.stdout == ""
    assert removed.stderr.strip().splitlines() == [
        f"milehpc: error: {tmp_path}/job.toml: data.source: {tmp_path}/data/train.jsonl is not bound into the "
        f"container (binds: {tmp_path}/run): add its directory to container.binds, or leave container.auto_binds on"]
    outside = _render(tmp_path, "--set", f'site.containers.apptainer.bind_roots=["{tmp_path}/run"]')
    assert outside.returncode == 2 and len(outside.stderr.strip().splitlines()) == 1
    assert "data.source: expected a path the site local lets a container bind" in outside.stderr
