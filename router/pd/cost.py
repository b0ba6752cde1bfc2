"""Predicted time to first token of one P/D option: a (prefill, decode) pair, or the
decode pod prefilling the request itself. Pure functions over plain data.

Disaggregated, the client's first token comes from the decode pod after the KV
arrived::

    ttft = prefill pod's ttft (queue + tier loads + recompute of what it lacks)
         + transfer of the KV the decode pod lacks over the pair's link
         + one decode step on the decode pod (slower with more running requests)

Aggregated on the decode pod it is the ordinary cost (``kvplane.router.cost``).
Both options are then scored for the choice, which adds what TTFT does not show:

- interference: the prefill stalls every request decoding on the pod that prefills
  (the decode pod when aggregated; a ``both`` pod prefilling for a pair). A decode
  step is memory-bound: the compute its own rows leave idle (step ms - running x
  ms per prefill token) takes that much prefill for free (Sarathi-Serve's stall-free
  batching); only the rest stalls them, so
  max(0, recompute ms - idle ms) x running requests x ``interference_weight``;
- balance (both, per decode pod): decode is bandwidth- and latency-bound, so a
  pod's running requests and KV usage are penalised and new work spreads;
- backlog (both): recomputed tokens also delay every request queued behind them on
  the pod that prefills, weighted as the aggregated policy weighs them,
  ``(recompute_weight - 1) x recompute ms``;
- exposure (both, per decode pod, ``exposure_weight``): the stall the request itself
  can expect while it decodes, from the prefills later routed to its decode pod. By
  Little's law about as many requests arrive during its life as are in flight now;
  the pod takes its share of recent prefill work of them. Interference alone sees only
  the stall a prefill causes now, so with ``both`` pods the pod with the fewest
  decodes always prefills for itself; exposure keeps decodes off the pods that prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.router.config import CostParams, LinkClass, LinkCost, PDSpec
from kvplane.router.cost import CostModel, CostTerms, PodLoad
from kvplane.router.pd.topology import transfer_ms


@dataclass(frozen=True, slots=True)
class OptionCost:
    """One way to serve the request; ``prefill`` None means on ``decode`` alone."""

    prefill: str | None
    decode: str
    prefill_terms: CostTerms  # on the prefill pod, or on the decode pod when aggregated
    link: LinkClass | None = None
    transfer_tokens: int = 0
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0
    interference_ms: float = 0.0
    balance_ms: float = 0.0
    backlog_ms: float = 0.0
    exposure_ms: float = 0.0

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def ttft_ms(self) -> float:
        return self.prefill_terms.ttft_ms + self.transfer_ms + self.decode_ms

    @property
    def score_ms(self) -> float:
        return (
            self.ttft_ms
            + self.interference_ms
            + self.balance_ms
            + self.backlog_ms
            + self.exposure_ms
        )


def running_requests(load: PodLoad) -> float:
    """Requests that decode on a pod: the engine's count, or the router's own if higher
    (every request in flight there decodes there, even while it waits for its KV)."""
    return max(load.engine_running, float(load.inflight))


def decode_step_ms(load: PodLoad, params: CostParams) -> float:
    """The decode pod's first step for the new request (its batch slows it down; a
    nearly full KV cache means preemptions first)."""
    step = params.decode_step_ms + running_requests(load) * params.running_step_ms_per_request
    if load.kv_usage >= params.kv_pressure_threshold:
        step += params.kv_pressure_penalty_ms
    return step


def interference_ms(recompute_ms: float, running: float, params: CostParams, pd: PDSpec) -> float:
    """The stall a prefill of ``recompute_ms`` imposes on the ``running`` requests
    decoding on the pod that runs it: what does not fit in the compute their own step
    leaves idle. A short tail of a resident prompt then costs them nothing, as on the
    engine, while a long prefill costs nearly its whole length."""
    step = params.decode_step_ms + running * params.running_step_ms_per_request
    idle = max(0.0, step - running * 1000.0 / params.prefill_tokens_per_s)
    return max(0.0, recompute_ms - idle) * running * pd.interference_weight


def balance_ms(load: PodLoad, pd: PDSpec) -> float:
    return (
        running_requests(load) * pd.decode_running_ms
        + load.inflight_tokens / 1000.0 * pd.decode_context_ms_per_ktok
        + load.kv_usage * pd.decode_kv_weight_ms
    )


def exposure_ms(
    share: float, fleet_inflight: float, mean_request_tokens: float, params: CostParams
) -> float:
    """Prefill a new request can expect on a decode pod during its life: the pod's
    ``share`` of recent prefill work times the work arriving meanwhile (``fleet_inflight``
    requests of ``mean_request_tokens``), at the prefill rate."""
    return share * fleet_inflight * mean_request_tokens / params.prefill_tokens_per_s * 1000.0


def backlog_ms(terms: CostTerms, params: CostParams) -> float:
    return (params.recompute_weight - 1.0) * terms.recompute_ms


@dataclass(frozen=True, slots=True)
class PDCostModel:
    """The aggregated cost model (parameters and model facts) with the P/D settings."""

    cost: CostModel
    pd: PDSpec

    @property
    def params(self) -> CostParams:
        return self.cost.params


@dataclass(frozen=True, slots=True)
class DecodeSide:
    """The decode pod of a pair, as the pair's cost needs it."""

    pod: str
    load: PodLoad
    resident_tokens: int = 0  # leading prompt tokens it holds already
    exposure_ms: float = 0.0  # unweighted (``exposure_ms``)
    pending_ms: float = 0.0  # prefill already queued there, which its first step waits behind


@dataclass(frozen=True, slots=True)
class Link:
    cls: LinkClass
    cost: LinkCost


def pair_cost(
    model: PDCostModel,
    prompt_tokens: int,
    prefill_terms: CostTerms,
    decode: DecodeSide,
    link: Link,
    prefill_running: float = 0.0,
) -> OptionCost:
    """Prefill on ``prefill_terms.pod``, decode on ``decode.pod``. The decode pod pulls
    only the blocks it does not hold already (vLLM counts its local prefix hit
    first, then loads the rest remotely). ``prefill_running``: requests decoding on
    the prefill pod (a ``both`` pod), which its prefill stalls."""
    params, pd, kv = model.params, model.pd, model.cost.kv_bytes_per_token
    tokens = max(0, prompt_tokens - max(0, decode.resident_tokens))
    return OptionCost(
        prefill=prefill_terms.pod,
        decode=decode.pod,
        prefill_terms=prefill_terms,
        link=link.cls,
        transfer_tokens=tokens,
        transfer_bytes=tokens * kv,
        transfer_ms=transfer_ms(tokens, kv, link.cost),
        decode_ms=decode.pending_ms + decode_step_ms(decode.load, params),
        interference_ms=interference_ms(prefill_terms.recompute_ms, prefill_running, params, pd),
        balance_ms=balance_ms(decode.load, pd),
        backlog_ms=backlog_ms(prefill_terms, params),
        exposure_ms=decode.exposure_ms * pd.exposure_weight,
    )


def aggregated_cost(
    model: PDCostModel, decode_terms: CostTerms, decode_load: PodLoad, exposure: float = 0.0
) -> OptionCost:
    """The decode pod prefills the request itself (``exposure``: unweighted)."""
    params, pd = model.params, model.pd
    running = running_requests(decode_load)
    return OptionCost(
        prefill=None,
        decode=decode_terms.pod,
        prefill_terms=decode_terms,
        interference_ms=interference_ms(decode_terms.recompute_ms, running, params, pd),
        balance_ms=balance_ms(decode_load, pd),
        backlog_ms=backlog_ms(decode_terms, params),
        exposure_ms=exposure * pd.exposure_weight,
    )
