"""Built-in megatron plugins (filled in by its issue)."""

from milehpc.hookspecs import hookimpl  # noqa: F401
