"""An example third-party milehpc plugin (rewards)."""
