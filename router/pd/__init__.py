"""Prefill/decode disaggregation: pair choice and the engines' handoff protocols."""
