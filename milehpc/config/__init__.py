"""Job specs and sites: models, loading, overrides, validation."""
