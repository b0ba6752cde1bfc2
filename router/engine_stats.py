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
A hand parser of the text format, because the router scrapes every pod every second on
its event loop: prometheus_client's parser builds every sample of every family and costs
tens of times more per vLLM page, a core's worth over a large fleet (measured:
bench/RESULTS.md, "Engine metrics parsing"). The tests check it against that parser on
real vLLM pages.
"""

from __future__ import annotations

from dataclasses import dataclass

_SUM = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
}
_PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
_MAX = {"vllm:kv_cache_usage_perc": "kv_usage", "sglang:token_usage": "kv_usage"}


@dataclass(frozen=True, slots=True)
class EngineStats:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    progress: float | None = None  # tokens computed so far (None: the engine has no such count)


def parse_metrics(text: str) -> EngineStats:
    acc: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[: brace if brace != -1 else line.find(" ")]
        if name in _SUM or name in _MAX or name in _PROGRESS:
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
    return EngineStats(**acc)
