"""The duration of one engine forward (scheduler step), as pure functions of a profile.

One step runs every scheduled token in a single forward pass: decode tokens of running
requests and prefill chunks together (vLLM's chunked prefill / Sarathi batching). The
weights are read once per forward, so a forward costs at least a memory floor, and
every token costs flops; ``hypot(floor, tokens / rate)`` joins the memory-bound and the
compute-bound regimes smoothly (a roofline with a soft corner). Attention is per
sequence and adds on top: quadratic in context for prefill chunks, a KV read of every
context token for decodes. See profiles.py for the calibration of each coefficient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvplane.sim.profiles import EngineProfile


def _batch_ms(profile: EngineProfile, batch: int) -> float:
    """The decode batch's forward without its KV reads: weights plus per-sequence work."""
    return (
        profile.decode_base_ms
        + profile.decode_per_seq_ms * batch
        + profile.decode_per_seq2_ms * batch * batch
    )


def decode_step_ms(profile: EngineProfile, batch: int, total_context_tokens: int) -> float:
    """A forward of ``batch`` decoding sequences that attend to ``total_context_tokens``."""
    if batch <= 0:
        return 0.0
    return _batch_ms(profile, batch) + profile.decode_per_kctx_ms * total_context_tokens / 1000.0


def decode_marginal_ms(profile: EngineProfile, batch: int, context_per_seq: int) -> float:
    """What one more decoding sequence adds to a step of ``batch`` (its share of the
    batch terms and its KV reads): a router's per-running-request cost."""
    return (
        profile.decode_per_seq_ms
        + profile.decode_per_seq2_ms * (2 * batch + 1)
        + profile.decode_per_kctx_ms * context_per_seq / 1000.0
    )


def step_ms(
    profile: EngineProfile,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_contexts: Sequence[int],
) -> float:
    """One forward: ``prefill_chunks`` are ``(new_tokens, context_before_chunk)`` pairs,
    ``decode_contexts`` the context length of every decoding sequence (new token
    included). 0.0 when nothing runs.

    ``hypot(base, prefill tokens / rate)`` with ``base`` the decode batch's forward, at
    least the prefill floor when a chunk runs: decode rows ride in the prefill's GEMMs. The KV
    reads of the decodes and the prefill attention are per sequence and add on top.
    """
    batch = len(decode_contexts)
    if not batch and not prefill_chunks:
        return 0.0
    base = _batch_ms(profile, batch) if batch else 0.0
    if prefill_chunks and base < profile.prefill_fixed_ms:
        base = profile.prefill_fixed_ms
    new_tokens = 0
    attention = 0.0
    for n, p in prefill_chunks:
        new_tokens += n
        attention += n * (p + n / 2.0)
    linear = new_tokens * 1000.0 / profile.prefill_tokens_per_s
    kv_reads = profile.decode_per_kctx_ms * sum(decode_contexts) / 1000.0
    return math.hypot(base, linear) + profile.attn_coeff * attention + kv_reads


def prefill_ms(profile: EngineProfile, new_tokens: int, cached_tokens: int) -> float:
    """A lone prompt's prefill: ``new_tokens`` computed after ``cached_tokens`` served
    from cache, in chunks of the profile's token budget (one forward each)."""
    total = 0.0
    done = 0
    budget = profile.max_num_batched_tokens
    while done < new_tokens:
        n = min(budget, new_tokens - done)
        total += step_ms(profile, [(n, cached_tokens + done)], [])
        done += n
    return total


def load_ms(profile: EngineProfile, tokens: int) -> float:
    """Loading ``tokens`` of KV back from the CPU tier over PCIe."""
    if tokens <= 0:
        return 0.0
    return tokens * profile.kv_bytes_per_token / (profile.cpu_bandwidth_gbps * 1e9) * 1000.0
