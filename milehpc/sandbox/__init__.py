"""Running untrusted programs (a policy's code) under limits: the ``sandbox`` plugin kind's interface and the
built-in backends (bubblewrap, apptainer, none). Rewards and tool environments use :func:`pool_for` / the
:class:`Sandbox` protocol; the job's or the site's choice of backend is resolved by :mod:`milehpc.sandbox.choice`."""

from milehpc.sandbox.types import Limits, RunResult, Sandbox, SandboxError

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxError"]
