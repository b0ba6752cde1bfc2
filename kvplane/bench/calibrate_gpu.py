"""Measure the simulator's timing quantities on a real GPU: a stand-alone script.

It builds a decoder of Llama-3.1-8B's shape (random bf16 weights: timing does not depend
on the values) in plain PyTorch and times, with CUDA events and CUDA graphs, the
quantities the simulator's engine profile predicts (:mod:`kvplane.sim.timing`):

- one forward of ``n`` prompt tokens with no context (the forward floor and prefill rate);
- a chunk of ``n`` tokens after ``p`` tokens of cached context (prefill attention);
- one decode step of ``b`` sequences, each attending to ``c`` tokens;
- host to GPU copies from pinned memory (a CPU-tier load) and back.

It needs only ``torch`` (it imports nothing from kvplane), so it runs on a GPU machine
that has PyTorch and nothing else: ``python kvplane/bench/calibrate_gpu.py --out F.json``.
``kvplane bench calibration F.json`` then sets the figures beside the model's.

What it is not: an engine. vLLM fuses norms and rotary embeddings, captures graphs per
batch shape and uses FlashAttention 3 on Hopper; this uses PyTorch's own kernels
(``scaled_dot_product_attention``'s best available backend, reported in the output). Its
figures are what a plain PyTorch forward reaches, so an engine's should be at least as
fast; the report says so beside each comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """The decoder's dimensions (Llama-3.1-8B's by default)."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256


TINY = Shape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)


class Decoder:
    """Weights of every layer and the forwards the measurements need."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.s, self.device, self.dtype = shape, device, dtype
        self.merged = True  # chunks after a context: see attention()
        q = shape.heads * shape.head_dim
        kv = shape.kv_heads * shape.head_dim
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims: int) -> torch.Tensor:
            t = torch.empty(*dims, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=g)

        self.embed = w(shape.vocab, shape.hidden)
        self.lm_head = w(shape.vocab, shape.hidden)
        self.layers = [
            {
                "qkv": w(q + 2 * kv, shape.hidden),
                "o": w(shape.hidden, q),
                "gate_up": w(2 * shape.intermediate, shape.hidden),
                "down": w(shape.hidden, shape.intermediate),
                "ln1": torch.ones(shape.hidden, device=device, dtype=dtype),
                "ln2": torch.ones(shape.hidden, device=device, dtype=dtype),
            }
            for _ in range(shape.layers)
        ]
        self.norm = torch.ones(shape.hidden, device=device, dtype=dtype)
        inv = 1.0 / (
            500000.0 ** (torch.arange(0, shape.head_dim, 2, device=device) / shape.head_dim)
        )
        self.inv_freq = inv.float()

    def new_cache(self, batch: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V of ``batch`` sequences of ``tokens`` (random: a cached context)."""
        s = self.s
        dims = (batch, s.kv_heads, tokens, s.head_dim)
        return [
            (
                torch.randn(dims, device=self.device, dtype=self.dtype),
                torch.randn(dims, device=self.device, dtype=self.dtype),
            )
            for _ in range(s.layers)
        ]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().to(self.dtype)[None, None]
        sin = freqs.sin().to(self.dtype)[None, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def forward(
        self,
        ids: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        past: int,
    ) -> torch.Tensor:
        """``ids`` [batch, n]: n new tokens per sequence after ``past`` cached ones, whose
        K and V are written into ``cache`` at ``past``; returns the last position's logits."""
        s = self.s
        batch, n = ids.shape
        positions = torch.arange(past, past + n, device=self.device)
        x = F.embedding(ids, self.embed)
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for layer, (k_cache, v_cache) in zip(self.layers, cache, strict=True):
            h = F.rms_norm(x, (s.hidden,), layer["ln1"], 1e-5)
            q, k, v = F.linear(h, layer["qkv"]).split((q_dim, kv_dim, kv_dim), dim=-1)
            q = self._rope(q.view(batch, n, s.heads, s.head_dim).transpose(1, 2), positions)
            k = self._rope(k.view(batch, n, s.kv_heads, s.head_dim).transpose(1, 2), positions)
            k_cache[:, :, past : past + n] = k
            v_cache[:, :, past : past + n] = v.view(batch, n, s.kv_heads, s.head_dim).transpose(
                1, 2
            )
            keys, values = k_cache[:, :, : past + n], v_cache[:, :, : past + n]
            attn = attention(q, keys, values, past, self.merged)
            x = x + F.linear(attn.transpose(1, 2).reshape(batch, n, q_dim), layer["o"])
            h = F.rms_norm(x, (s.hidden,), layer["ln2"], 1e-5)
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        last = F.rms_norm(x[:, -1], (s.hidden,), self.norm, 1e-5)
        return F.linear(last, self.lm_head)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, merged: bool = True
) -> torch.Tensor:
    """Causal attention of the new queries: the cached context in full, the new tokens
    causally (bottom-right aligned); a decode (one query) attends to everything. A chunk
    after a context runs as two FlashAttention calls merged (``merged``, on a GPU) or as
    one masked call."""
    n = q.shape[2]
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if merged and q.is_cuda:
        return _merged_flash(q, k, v, past)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(n, past + n)
    rep = q.shape[1] // k.shape[1]  # the lower-right bias takes no enable_gqa
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
    )


def _merged_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """A chunk after ``past`` cached tokens as FlashAttention kernels run it: the queries
    against the context (no mask) and against themselves (causal), joined by their
    log-sum-exps. PyTorch's public call has no bottom-right causal flash path, so this
    uses its flash operator, which returns the log-sum-exp."""
    rep = q.shape[1] // k.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    ctx_k, ctx_v = (
        k[:, :, :past].repeat_interleave(rep, 1),
        v[:, :, :past].repeat_interleave(rep, 1),
    )
    new_k, new_v = (
        k[:, :, past:].repeat_interleave(rep, 1),
        v[:, :, past:].repeat_interleave(rep, 1),
    )
    o1, l1 = flash(q, ctx_k, ctx_v, 0.0, False)[:2]
    o2, l2 = flash(q, new_k, new_v, 0.0, True)[:2]
    lse = torch.logaddexp(l1, l2)
    w1, w2 = (l1 - lse).exp().unsqueeze(-1), (l2 - lse).exp().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(q.dtype)


def _merged_error(device: torch.device, dtype: torch.dtype) -> float:
    """The merged flash chunk against the masked reference on random data (a check that
    the two compute the same attention)."""
    q = torch.randn(1, 8, 64, 128, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, 320, 128, device=device, dtype=dtype) for _ in range(2))
    joined = _merged_flash(q, k, v, 256)
    reference = attention(q, k, v, 256, merged=False)
    return float((joined.float() - reference.float()).abs().max())


EAGER: list[str] = []  # what could not be captured in a CUDA graph and ran eagerly


def timed_ms(
    fn: Callable[[], object], device: torch.device, reps: int, graph: bool, what: str = ""
) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after warm-up (a CUDA graph replay
    where ``graph`` and the device allow, which removes Python's launch overhead)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(times)
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except RuntimeError as exc:  # an op that cannot be captured: time it eagerly
            EAGER.append(f"{what}: {str(exc).splitlines()[0][:200]}")
            torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@dataclass(frozen=True)
class Plan:
    """What to measure."""

    forward_tokens: tuple[int, ...] = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192)
    long_prompts: tuple[int, ...] = (16384, 32768)
    chunk_tokens: int = 8192
    chunk_contexts: tuple[int, ...] = (8192, 32768, 65536)
    decode_batches: tuple[int, ...] = (1, 25, 50, 100, 150, 200)
    decode_context: int = 256
    copy_tokens: tuple[int, ...] = (16, 64, 512, 4096)
    reps: int = 10


TINY_PLAN = Plan(
    forward_tokens=(1, 16, 64),
    long_prompts=(128,),
    chunk_tokens=32,
    chunk_contexts=(64,),
    decode_batches=(1, 4),
    decode_context=16,
    copy_tokens=(16,),
    reps=2,
)


def measure(shape: Shape, plan: Plan, device: torch.device, graph: bool) -> dict[str, Any]:
    """Every figure of the plan, in milliseconds (copies in GB/s)."""
    dtype = torch.bfloat16
    model = Decoder(shape, device, dtype)
    out: dict[str, Any] = {}

    def prefill(n: int, past: int) -> float:
        cache = model.new_cache(1, past + n)
        ids = torch.randint(0, shape.vocab, (1, n), device=device)
        with torch.inference_mode():
            ms = timed_ms(
                partial(model.forward, ids, cache, past), device, plan.reps, graph, f"{n}@{past}"
            )
        del cache
        return ms

    out["forward_ms"] = {str(n): prefill(n, 0) for n in plan.forward_tokens}
    out["prompt_ms"] = {str(n): prefill(n, 0) for n in plan.long_prompts}
    out["chunk_tokens"] = plan.chunk_tokens
    try:
        out["chunk_ms"] = {str(p): prefill(plan.chunk_tokens, p) for p in plan.chunk_contexts}
    except RuntimeError as exc:  # no flash operator here: the masked kernel alone
        out["merged_failed"] = str(exc).splitlines()[0][:300]
        model.merged = False
        out["chunk_ms"] = {str(p): prefill(plan.chunk_tokens, p) for p in plan.chunk_contexts}
    if device.type == "cuda" and model.merged:  # the same chunks through one masked kernel
        out["merged_max_abs_err"] = _merged_error(device, dtype)
        model.merged = False
        out["chunk_masked_ms"] = {
            str(p): prefill(plan.chunk_tokens, p) for p in plan.chunk_contexts
        }
        model.merged = True

    decode: dict[str, float] = {}
    for b in plan.decode_batches:
        cache = model.new_cache(b, plan.decode_context + 1)
        ids = torch.randint(0, shape.vocab, (b, 1), device=device)
        with torch.inference_mode():
            step = partial(model.forward, ids, cache, plan.decode_context)
            decode[str(b)] = timed_ms(step, device, plan.reps, graph, f"decode {b}")
        del cache
    out["decode_context"] = plan.decode_context
    out["decode_ms"] = decode

    kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    out["kv_bytes_per_token"] = kv_bytes
    if device.type == "cuda":
        h2d, d2h = {}, {}
        for tokens in plan.copy_tokens:
            host = torch.empty(tokens * kv_bytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty_like(host, device=device)
            up = partial(dev.copy_, host, non_blocking=True)
            h2d[str(tokens)] = tokens * kv_bytes / timed_ms(up, device, plan.reps, False) / 1e6
            down = partial(host.copy_, dev, non_blocking=True)
            d2h[str(tokens)] = tokens * kv_bytes / timed_ms(down, device, plan.reps, False) / 1e6
        out["h2d_gbps"], out["d2h_gbps"] = h2d, d2h
    return out


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name, sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30
        )
        env["sdpa_flash"] = torch.backends.cuda.flash_sdp_enabled()
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", required=True, help="where to write the figures (JSON)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny decoder and plan (a dry run)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches, no CUDA graphs")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    shape, plan = (TINY, TINY_PLAN) if a.tiny else (Shape(), Plan())
    t0 = time.monotonic()
    doc = {
        "shape": asdict(shape),
        "graph": not a.no_graph and device.type == "cuda",
        "environment": environment(device),
        **measure(shape, plan, device, graph=not a.no_graph),
    }
    doc["eager"] = EAGER
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    json.dump(doc, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0 if all(math.isfinite(v) for v in doc["forward_ms"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
