"""Built-in plugins. Each module is an entry point of the group ``milehpc`` in pyproject.toml, so the
built-ins are loaded exactly like third-party plugins."""
