"""A vLLM-compatible engine simulator: the same HTTP, metrics and KV-event interfaces,
with a paged prefix cache, continuous batching and an H100 timing model."""
