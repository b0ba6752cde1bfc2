"""Benchmarks for the kvplane router (``kvplane bench ...``).

They measure the router against a no-op engine so that the figures are the
router's own cost, not an engine's, and they run competing routers side by side
in the same process tree and the same minutes, because on a shared machine only
ratios taken together mean anything.
"""
