"""Built-in sglang plugins (filled in by its issue)."""

from milehpc.hookspecs import hookimpl  # noqa: F401
