"""The duration of one engine forward (scheduler step), as pure functions of a profile.

One step runs every scheduled token in a single forward pass: decode tokens of running
requests and prefill chunks together (vLLM's chunked prefill / Sarathi batching). The
weights are read once per forward, so a forward costs at least a memory floor, and
every token costs flops; ``hypot(floor, tokens / rate)`` joins the memory-bound and the
compute-bound regimes smoothly (a roofline with a soft corner). Prefill attention is
per sequence and quadratic in context, so it adds on top. See profiles.py for the
calibration of each coefficient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvplane.sim.profiles import EngineProfile


def decode_step_ms(profile: EngineProfile, batch: int, total_context_tokens: int) -> float:
    """A forward of ``batch`` decoding sequences that attend to ``total_context_tokens``."""
    if batch <= 0:
        return 0.0
    return (
        profile.decode_base_ms
        + profile.decode_per_seq_ms * batch
        + profile.decode_per_seq2_ms * batch * batch
        + profile.decode_per_kctx_ms * total_context_tokens / 1000.0
    )


def step_ms(
    profile: EngineProfile,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_contexts: Sequence[int],
) -> float:
    """One forward: ``prefill_chunks`` are ``(new_tokens, context_before_chunk)`` pairs,
    ``decode_contexts`` the context length of every decoding sequence (new token
    included). 0.0 when nothing runs."""
    batch = len(decode_contexts)
    if batch:
        base = decode_step_ms(profile, batch, sum(decode_contexts))
    elif prefill_chunks:
        base = profile.prefill_fixed_ms
    else:
        return 0.0
    new_tokens = 0
    attention = 0.0
    for n, p in prefill_chunks:
        new_tokens += n
        attention += n * (p + n / 2.0)
    linear = new_tokens * 1000.0 / profile.prefill_tokens_per_s
    return math.hypot(base, linear) + profile.attn_coeff * attention


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
