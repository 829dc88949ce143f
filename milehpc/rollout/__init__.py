"""Rollout engines (the ``Engine`` protocol the loop calls; the reference engine on CPU, its supervised
out-of-process form, SGLang and its pure request/weight mapping) and the router that splits prompts over them."""
