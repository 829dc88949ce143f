"""The pinned versions of the GPU-path libraries: pyproject pins what the tests ran against, and `milehpc doctor`
says in one line when the installed megatron-core differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from milehpc.config import tested_versions as tv

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_pins_the_tested_versions_and_the_venv_has_them() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"megatron-core=={tv.TESTED_MEGATRON_CORE}" in project["dependencies"]
    assert f"transformer-engine[pytorch]=={tv.TESTED_TRANSFORMER_ENGINE}" in project["optional-dependencies"]["gpu"]
    assert tv.installed_version("megatron-core") == tv.TESTED_MEGATRON_CORE


def test_doctor_warns_in_one_line_when_megatron_core_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    from milehpc.doctor import WARN, Doctor

    monkeypatch.setattr(tv, "installed_version", lambda name: "0.99.0" if name == "megatron-core" else None)
    doctor = Doctor("local")
    doctor.check_versions()
    assert [(f.check, f.level) for f in doctor.findings] == [("megatron-core", WARN)]
    assert "\n" not in doctor.findings[0].message and "0.99.0" in doctor.findings[0].message
    assert tv.TESTED_MEGATRON_CORE in doctor.findings[0].message

    tested = {"megatron-core": tv.TESTED_MEGATRON_CORE, **tv.TESTED_GPU_PACKAGES}
    monkeypatch.setattr(tv, "installed_version", tested.get)
    quiet = Doctor("local")
    quiet.check_versions()
    assert quiet.findings == []

    # sglang and torch_memory_saver (the gpu extra's pins) are checked the same way.
    monkeypatch.setattr(tv, "installed_version", lambda name: "0.0.1" if name in tv.TESTED_GPU_PACKAGES else None)
    gpu = Doctor("local")
    gpu.check_versions()
    assert sorted(f.check for f in gpu.findings) == ["sglang", "torch_memory_saver"]
