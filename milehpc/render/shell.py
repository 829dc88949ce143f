"""Making values safe for the shell scripts we render: quote everything, or validate it first."""

from __future__ import annotations

import re
import shlex

# An environment value may refer to other variables (${USER}, $SLURM_JOB_ID) and is then rendered in double
# quotes; only characters that are inert inside double quotes are allowed beside the references.
_REF_SAFE = re.compile(r"(?:[A-Za-z0-9_./:,=@%+\-* ]|\$\{[A-Za-z_][A-Za-z0-9_]*\}|\$[A-Za-z_][A-Za-z0-9_]*)*")


def q(value: object) -> str:
    """Quote one word for the shell."""
    return shlex.quote(str(value))


def env_value(value: str) -> str:
    """An environment value: with ``$VAR`` references and nothing else special → double quotes (expands the
    references); anything else → single-quoted verbatim, so ``$(id)`` or backticks stay text."""
    if "$" in value and _REF_SAFE.fullmatch(value):
        return f'"{value}"'
    return shlex.quote(value)


def comment(value: object) -> str:
    """Text for a ``#`` comment line: a newline in it must not end the comment."""
    return re.sub(r"[\r\n]+", " ", str(value))


def join(words: list[str]) -> str:
    return " ".join(q(w) for w in words)


_SAFE_PATH = re.compile(r"[A-Za-z0-9_./@%+,:=-]+")


def sbatch_path(path: str) -> bool:
    """Whether a path can go on an ``#SBATCH`` line (sbatch parses those itself, not the shell)."""
    return bool(_SAFE_PATH.fullmatch(path))
