"""Skips that CI must not take: a test whose precondition (the test Slurm cluster, an MPI with ULFM) is missing
skips, with the reason, on a developer machine; with ``MILEHPC_REQUIRE_ALL=1`` (set by ``.ci/run``) it fails with
the same reason instead, so that a suite that lost its only real requeue-and-resume test cannot exit 0."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "MILEHPC_REQUIRE_ALL"


def required() -> bool:
    """True when missing preconditions must fail: the flag is set to anything but empty or ``0``."""
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0")


def unavailable(reason: str) -> NoReturn:
    """Skip (plain run) or fail (``MILEHPC_REQUIRE_ALL=1``) the current test, naming ``reason`` either way."""
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: required tests may not skip)", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_ENV}=1 to make this a failure)")


def require_module(name: str) -> ModuleType:
    """``name`` imported, for a test module that needs a package of the dev extra (CI always installs it): missing,
    the module's tests skip on a plain run and fail under ``MILEHPC_REQUIRE_ALL=1``, naming the package."""
    try:
        return importlib.import_module(name)
    except ImportError:
        reason = f"the Python package '{name}' is not installed (pip install -e '.[dev]')"
        if required():
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1: required tests may not skip)", pytrace=False)
        pytest.skip(f"{reason} (set {REQUIRE_ENV}=1 to make this a failure)", allow_module_level=True)
