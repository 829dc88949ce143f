"""User-facing errors: one line that names the file and field, exit code 2, never a traceback."""

from __future__ import annotations


class MilehpcError(Exception):
    """An error the user can fix. The CLI prints ``str(err)`` on one line and exits with ``exit_code``."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None) -> None:
        self.file = file
        self.field = field
        self.message = message
        super().__init__(self.format())

    def format(self) -> str:
        where = ""
        if self.file and self.field:
            where = f"{self.file}: {self.field}: "
        elif self.file:
            where = f"{self.file}: "
        elif self.field:
            where = f"{self.field}: "
        # One line, always: a newline in a user value must not split the message.
        return (where + self.message).replace("\n", "\\n")


class ConfigError(MilehpcError):
    """A job spec, site config or override is wrong."""


class PluginError(MilehpcError):
    """A plugin is missing, clashes with another, or its optional dependency is not installed."""


class SchedulerError(MilehpcError):
    """Slurm is absent, refused a request, or the job id is unknown."""


class StorageError(MilehpcError):
    """Disk full, quota exceeded or permission denied on a path milehpc writes; the message names the path."""

    exit_code = 1


class RuntimeFailure(MilehpcError):
    """Something inside the job failed (a rank died, a collective timed out); exit code 1."""

    exit_code = 1


def missing_dependency(what: str, package: str, extra: str = "gpu") -> PluginError:
    """The one line for a plugin whose optional package is not installed."""
    return PluginError(
        f"{what} needs the Python package '{package}', which is not installed "
        f"(install it in a GPU environment: pip install 'milehpc[{extra}]')"
    )


def did_you_mean(name: str, choices: object) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices`` to a misspelled ``name`` (difflib), else ``""``."""
    import difflib

    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=0.75)  # type: ignore[attr-defined]
    return f"; did you mean '{close[0]}'?" if close else ""

