"""Engine /metrics text -> the few load figures the cost model reads.

vLLM 0.33 names (labels ``model_name``, ``engine`` per DP rank; summed here):
``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (0..1, the max over ranks), the prefix cache
counters, and ``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total`` as the
engine's progress (vLLM counts them at every engine step, so a hung engine core shows
as counters that stop while ``/health`` still answers). SGLang's load figures are read
too, so one router serves both; SGLang counts its token totals only when a request
finishes, which says nothing about a long generation in between, so an SGLang pod has
no progress figure.
KV capacity: vLLM's ``vllm:cache_config_info`` is an info gauge whose labels are the
engine's CacheConfig (``num_gpu_blocks``, ``block_size``; one series per DP rank, summed);
its ``kv_cache_usage_perc`` is over ``num_gpu_blocks - 1`` blocks (one is vLLM's null
block), so that is the capacity. SGLang reports ``sglang:max_total_num_tokens``. With the
usage, the cost model knows how much KV a pod has free for a new prompt.
LoRA (vLLM with ``--enable-lora``): ``vllm:lora_requests_info`` is a gauge whose labels
``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated adapter names)
and ``max_lora`` describe the engine's adapters, and whose value is the time it was set;
vLLM keeps one series per label set ever seen, so the newest (largest value) is now.
A hand parser of the text format, because the router scrapes every pod every second on
its event loop: prometheus_client's parser builds every sample of every family and costs
tens of times more per vLLM page, a core's worth over a large fleet (measured:
bench/RESULTS.md, "Engine metrics parsing"). The tests check it against that parser on
real vLLM pages.
"""

from __future__ import annotations

from dataclasses import dataclass

LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

_SUM = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:max_total_num_tokens": "kv_capacity_tokens",
}
_PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
_MAX = {"vllm:kv_cache_usage_perc": "kv_usage", "sglang:token_usage": "kv_usage"}


@dataclass(frozen=True, slots=True)
class LoraState:
    """The engine's adapters with requests running or waiting, and its adapter slots
    (vLLM's ``--max-loras``: adapters in one batch)."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_loras: int = 1


@dataclass(frozen=True, slots=True)
class EngineStats:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    kv_capacity_tokens: float = 0.0  # KV the engine can hold (0: it does not say)
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    progress: float | None = None  # tokens computed so far (None: the engine has no such count)
    lora: LoraState | None = None  # None: the engine reports no LoRA state


def _label(labels: str, name: str) -> str | None:
    """One label's value in ``a="x",b="y"`` (adapter names hold no quotes or commas)."""
    key = name + '="'
    at = labels.find(key)
    while at > 0 and labels[at - 1] not in ", {":  # a longer name ending in this one
        at = labels.find(key, at + 1)
    if at == -1:
        return None
    start = at + len(key)
    end = labels.find('"', start)
    return None if end == -1 else labels[start:end]


def _names(value: str | None) -> frozenset[str]:
    return frozenset(n for n in (value or "").split(",") if n)


def parse_lora(line: str) -> tuple[float, LoraState] | None:
    """(set time, state) of one ``vllm:lora_requests_info`` sample line."""
    open_, close = line.find("{"), line.rfind("}")
    if open_ == -1 or close < open_:
        return None
    labels = line[open_ + 1 : close]
    try:
        at = float(line[close + 1 :].split()[0])
        max_loras = int(_label(labels, "max_lora") or "")
    except (ValueError, IndexError):
        return None
    running = _names(_label(labels, "running_lora_adapters"))
    waiting = _names(_label(labels, "waiting_lora_adapters"))
    return at, LoraState(running, waiting, max_loras)


def parse_capacity(line: str) -> float | None:
    """Tokens of KV one ``vllm:cache_config_info`` sample line describes."""
    open_, close = line.find("{"), line.rfind("}")
    if open_ == -1 or close < open_:
        return None
    labels = line[open_ + 1 : close]
    try:
        blocks = int(_label(labels, "num_gpu_blocks") or "")
        block_size = int(_label(labels, "block_size") or "")
    except ValueError:  # absent, or "None" before the engine sized its cache
        return None
    return float(max(0, blocks - 1) * block_size)


def parse_metrics(text: str) -> EngineStats:
    acc: dict[str, float] = {}
    lora: tuple[float, LoraState] | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[: brace if brace != -1 else line.find(" ")]
        if name == LORA_INFO:
            sample = parse_lora(line)
            if sample is not None and (lora is None or sample[0] >= lora[0]):
                lora = sample
        elif name == CACHE_CONFIG_INFO:
            tokens = parse_capacity(line)
            if tokens is not None:
                acc["kv_capacity_tokens"] = acc.get("kv_capacity_tokens", 0.0) + tokens
        elif name in _SUM or name in _MAX or name in _PROGRESS:
            # "name{labels} value [timestamp]"
            rest = line[line.rfind("}") + 1 :] if brace != -1 else line[len(name) :]
            try:
                value = float(rest.split()[0])
            except (ValueError, IndexError):
                continue
            if name in _SUM:
                field = _SUM[name]
                acc[field] = acc.get(field, 0.0) + value
            elif name in _PROGRESS:
                acc["progress"] = acc.get("progress", 0.0) + value
            else:
                field = _MAX[name]
                acc[field] = max(acc.get(field, 0.0), value)
    return EngineStats(**acc, lora=None if lora is None else lora[1])
