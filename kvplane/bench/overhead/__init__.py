"""``kvplane bench overhead``: router-added latency and max req/s against a no-op engine.

Compared side by side in one run, on the same no-op backends and the same prompts:
kvplane and the PyPI ``vllm-router`` with its ``round_robin``, ``cache_aware`` and
``kv_aware`` policies, for prompts of 1K/8K/32K tokens in two regimes (``fresh``:
every prompt new; ``shared``: ~95% of each prompt repeats an earlier one).

kvplane runs as one process with its in-memory index (``kvplane``) and, for each
``--kvplane-workers`` count N > 1, as N uvicorn worker processes sharing a Redis
index on a ``redis-server`` the benchmark starts (``kvplane-wN``), as a deployment
that scales the router over cores would run it.

Method (why it is built this way):

* Added latency is paired: each prompt goes once through the router and once
  straight to a backend, back to back on the same client, in alternating order, and
  the router's share is the difference. Every router runs during the whole run and
  the routers take turns prompt by prompt, so a noisy neighbour on a shared
  machine hits all of them alike. Percentiles are taken over the differences.
* The client is a bare asyncio HTTP/1.1 client on uvloop with pre-encoded requests,
  so that the load generator costs little next to what it measures.
* Max sustainable req/s is open-loop (requests leave on a fixed schedule whether or
  not earlier ones returned, latency counted from the scheduled time, so a
  saturated router cannot hide its queue): the rate doubles until a step fails,
  then bisects; a failed rate is retried once (a neighbour's spike decides a short
  step otherwise). A step passes with no error and p99 below
  ``max(--p99-bound-ms, 4 x standalone tokenization p50, 4 x the router's own
  unloaded p50)``: a fixed SLO at small prompts, one that scales with unavoidable
  tokenization at large ones, and for a router slower than that even when idle,
  the point where queueing takes over (its latency is reported separately).
* Standalone tokenization is the transformers fast tokenizer's ``encode`` of the
  same prompts in this process: the floor for any router that tokenizes.

vllm-router 0.1.17's ``kv_aware`` discovers each worker with ``GET
/get_server_info`` (model id, KV block size) and ``GET /kv_event_sources`` (ZMQ
endpoints, keyed by data-parallel rank), and tokenizes every request by calling
``POST /v1/completions/render`` on *every* worker (then ``/tokenize``; with
neither it routes on load alone, "missing_tokens"). ``cache_aware`` tokenizes the
same way in this version. The no-op backends therefore render with the same
tokenizer and bind a silent ZMQ PUB socket, so both policies do their full
per-request work, as against vLLM engines.
"""

from kvplane.bench.overhead.fleet import router_specs
from kvplane.bench.overhead.prompts import PromptFactory, count_tokens, load_counter
from kvplane.bench.overhead.report import check_targets, render_markdown, update_markdown
from kvplane.bench.overhead.run import add_arguments, main, run
from kvplane.bench.overhead.scope import ROUTERS

__all__ = [
    "ROUTERS",
    "PromptFactory",
    "add_arguments",
    "check_targets",
    "count_tokens",
    "load_counter",
    "main",
    "render_markdown",
    "router_specs",
    "run",
    "update_markdown",
]
