"""Shared-cluster hygiene (private dirs, masked secrets, one-line storage errors) and the checkpoint-request
contract between the job script and the ranks."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from pathlib import Path

import pytest

from milehpc import hygiene
from milehpc.checkpoint import Checkpointer
from milehpc.errors import StorageError
from milehpc.runtime import signals


def test_private_dir_ignores_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        d = hygiene.make_private_dir(tmp_path / "a" / "run")
        assert oct(d.stat().st_mode & 0o777) == "0o700"
        d2 = hygiene.make_private_dir(tmp_path / "b", "0750")
        assert oct(d2.stat().st_mode & 0o777) == "0o750"
    finally:
        os.umask(old)


def test_secrets_masked_in_env_text_and_logs(caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"HF_TOKEN": "hf_abcdefgh123", "WANDB_API_KEY": "k" * 40, "DB_PASSWORD": "pw-1234",
           "NCCL_DEBUG": "INFO", "MY_SECRET": ""}
    assert hygiene.mask_env(env) == {"HF_TOKEN": "***", "WANDB_API_KEY": "***", "DB_PASSWORD": "***",
                                     "NCCL_DEBUG": "INFO", "MY_SECRET": ""}
    text = "export HF_TOKEN=hf_abcdefgh123\nurl=https://x?t=hf_abcdefgh123 pw-1234 NCCL_DEBUG=INFO\nAPI_KEY='inline'"
    masked = hygiene.mask_text(text, env)
    assert "hf_abcdefgh123" not in masked and "pw-1234" not in masked and "inline" not in masked
    assert "NCCL_DEBUG=INFO" in masked and "API_KEY=***" in masked
    assert hygiene.mask_text('export HF_TOKEN="$HF_TOKEN"', {}) == 'export HF_TOKEN="$HF_TOKEN"'
    plain, secret = hygiene.split_secret_env(env)
    assert plain == {"NCCL_DEBUG": "INFO"} and secret == ["DB_PASSWORD", "HF_TOKEN", "MY_SECRET", "WANDB_API_KEY"]

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefgh123")
    logger = logging.getLogger("milehpc.test_hygiene")
    hygiene.install_log_masking(logger)
    hygiene.install_log_masking(logger)
    assert sum(isinstance(f, hygiene.SecretMaskingFilter) for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger="milehpc.test_hygiene"):
        logger.info("env token=%s", "hf_abcdefgh123")
    assert "hf_abcdefgh123" not in caplog.text and "token=***" in caplog.text


def test_disk_full_is_one_line_with_the_path() -> None:
    with pytest.raises(StorageError) as err, hygiene.storage_errors("/dev/full"), open("/dev/full", "w") as f:
        f.write("x" * 10000)
        f.flush()
    msg = str(err.value)
    assert msg.startswith("no space left on device writing /dev/full") and "\n" not in msg
    assert err.value.exit_code == 1


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A real 256 KiB tmpfs (needs root, as on CI); skipped with the reason otherwise."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs to fill up: {r.stderr.strip() or r.returncode}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_checkpoint_on_a_full_disk_names_the_path(tiny_fs: Path) -> None:
    import torch

    ck = Checkpointer(tiny_fs / "ckpt")
    ck.save(1, {"w": torch.zeros(10)})
    with pytest.raises(StorageError) as err:
        ck.save(2, {"w": torch.zeros(200_000)})  # 800 kB into 256 KiB
    msg = str(err.value)
    assert "no space left on device" in msg and str(tiny_fs / "ckpt") in msg and "\n" not in msg
    # the complete checkpoint before it is intact and still found
    assert Checkpointer(tiny_fs / "ckpt").resume().info.step == 1


def test_permission_error_is_one_line_with_the_path() -> None:
    target = Path("/sys/kernel/milehpc-test-dir")
    try:
        target.mkdir()
    except PermissionError:
        pass
    except OSError as err:
        pytest.skip(f"this kernel does not refuse mkdir in /sys with EACCES/EPERM: {err}")
    else:
        target.rmdir()
        pytest.skip("mkdir in /sys was allowed here")
    with pytest.raises(StorageError) as err:
        hygiene.make_private_dir(target)
    msg = str(err.value)
    assert ("permission denied" in msg or "not permitted" in msg) and str(target) in msg and "\n" not in msg


# ---- the request contract -----------------------------------------------------------------------------


def test_request_is_polled_only_by_rank_zero_and_acknowledged(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    w0, w1 = signals.RequestWatcher(tmp_path, rank=0), signals.RequestWatcher(tmp_path, rank=1)
    assert not w0.requested()
    signals.request_checkpoint(tmp_path, "test")
    assert w0.requested() and not w1.requested()
    w1.acknowledge(4, tmp_path / "ck")
    assert w0.requested()  # only rank 0 consumes it
    w0.acknowledge(4, tmp_path / "ck")
    assert not w0.requested()
    done = json.loads(signals.checkpointed_path(tmp_path).read_text())
    assert done["step"] == 4 and done["restart_count"] == 2 and done["checkpoint"].endswith("ck")
    assert oct((tmp_path / ".milehpc").stat().st_mode & 0o777) == "0o700"


def test_restart_count_sources() -> None:
    assert signals.restart_count({}) == 0
    assert signals.restart_count({"SLURM_RESTART_COUNT": "3", "MILEHPC_RESTART_COUNT": "1"}) == 3
    assert signals.restart_count({"MILEHPC_RESTART_COUNT": "1"}) == 1
    assert signals.restart_count({"SLURM_RESTART_COUNT": "junk"}) == 0


def test_forward_signals_turns_usr1_into_a_request(tmp_path: Path) -> None:
    previous = signals.forward_signals(tmp_path, (signal.SIGUSR1,))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.request_path(tmp_path).read_text().startswith("signal SIGUSR1")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_render_uses_the_same_contract() -> None:
    from milehpc.render import script

    assert script.REQUEST_FILE == signals.REQUEST_FILE and script.EXIT_REQUEUE == signals.EXIT_REQUEUE
    assert script.STOP_FILE == signals.STOP_FILE


def test_a_secret_value_in_the_job_file_is_refused_in_one_line() -> None:
    from milehpc.config.job import JobSpec
    from milehpc.config.schema import build
    from milehpc.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        build(JobSpec, {"name": "x", "env": {"WANDB_API_KEY": "k" * 32}}, file="job.toml")
    msg = str(err.value)
    assert msg.startswith("job.toml: env.WANDB_API_KEY: ") and "k" * 32 not in msg and "\n" not in msg
    # a reference (passed by environment) and ordinary variables are fine
    job = build(JobSpec, {"name": "x", "env": {"HF_TOKEN": "$HF_TOKEN", "NCCL_DEBUG": "INFO"}}, file="job.toml")
    assert job.env["NCCL_DEBUG"] == "INFO"


def test_login_node_import_stays_light() -> None:
    import subprocess
    import sys

    code = ("import sys, milehpc.hygiene, milehpc.runtime.signals, milehpc.checkpoint; "
            "print(' '.join(m for m in ('torch', 'numpy', 'h5py', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""
