"""The P:D planner: its recommendation follows a workload shift in the P/D discrete-event
simulation; it reads its observation from a real router's /metrics; the operator hook
publishes the plan in the InferencePool's status and as metrics, and applies it to the
pool's PrefillPool and DecodePool on the real API server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvplane.operator.planner import (
    Budget,
    Observation,
    Plan,
    PlannerSetup,
    Targets,
    observe,
    planning_workload,
    recommend,
    sample,
)
from kvplane.operator.planner_hook import PlannerHook
from kvplane.router.config import PDSpec, RouterConfig
from kvplane.router.kube import Kube
from kvplane.router.telemetry import RouterMetrics
from prometheus_client import generate_latest
from support.fake_engine import FakeEngine, serve_engines
from support.k8s_cluster import K8sCluster
from support.router_server import deepseek_tokenizer_dir, serve_router

CRDS = Path(__file__).resolve().parents[1] / "crds"
SETUP = PlannerSetup(PDSpec.model_validate({"connector": "nixl"}), requests=120)
TARGETS = Targets(ttft_ms=1000.0, itl_ms=40.0)
BUDGET = Budget(2, 12)

PREFILL_HEAVY = Observation(
    arrival_rate=4.0, prompt_tokens=8000, output_tokens=150, prefix_reuse=0.1
)
DECODE_HEAVY = Observation(
    arrival_rate=30.0, prompt_tokens=300, output_tokens=1000, prefix_reuse=0.5
)


def test_the_planning_workload_has_the_observed_shape() -> None:
    obs = Observation(arrival_rate=5.0, prompt_tokens=2000, output_tokens=100, prefix_reuse=0.6)
    w = planning_workload(obs, 400, seed=1)
    n = len(w.requests)
    assert abs(w.offered_rps - 5.0) / 5.0 < 0.15
    assert abs(sum(r.input_length for r in w.requests) / n - 2000) < 100
    assert abs(sum(r.output_tokens for r in w.requests) / n - 100) < 10
    # the shared head of each prompt (segments other requests of its group also open with)
    shared = sum(sum(1 for s in r.segments if s < 8 * 4096) * w.segment_tokens for r in w.requests)
    assert abs(shared / w.prompt_tokens - 0.6) < 0.05


def test_the_recommendation_follows_a_workload_shift() -> None:
    """Prefill-heavy traffic gets more prefill than decode replicas; when the traffic
    shifts to short prompts and long outputs the plan turns to decode; twice the
    prefill-heavy rate needs a larger fleet. Each plan meets the targets in the DES, and
    every smaller fleet it tried did not."""
    plans: dict[str, Plan] = {}
    for name, obs in (
        ("prefill-heavy", PREFILL_HEAVY),
        ("decode-heavy", DECODE_HEAVY),
        ("prefill-heavy x2", Observation(8.0, 8000, 150, 0.1)),
    ):
        plans[name] = plan = recommend(obs, TARGETS, BUDGET, SETUP)
        assert plan.meets_targets, (name, plan)
        total = plan.prefill + plan.decode
        for t in plan.trials:
            if t.prefill + t.decode < total:
                assert t.score(TARGETS) > 1.0, (name, t)
    a, b, c = plans["prefill-heavy"], plans["decode-heavy"], plans["prefill-heavy x2"]
    assert a.prefill > a.decode
    assert b.decode > b.prefill
    assert c.prefill + c.decode > a.prefill + a.decode and c.prefill > a.prefill


def test_the_budget_bounds_the_plan() -> None:
    plan = recommend(Observation(8.0, 8000, 150, 0.1), TARGETS, Budget(2, 3), SETUP)
    assert plan.prefill + plan.decode <= 3
    assert not plan.meets_targets  # the best the budget allows, reported as such


def metrics_text(requests: int, prompt: int, cached: int, output: int) -> str:
    """A router's /metrics with these totals, from the router's own metric objects."""
    m = RouterMetrics("llama", "m")
    for i in range(requests):
        m.decisions.labels("llama", "m", "best_cost", f"pod-{i % 2}").inc()
        m.chose(None, output)
    m.prompt_tokens.labels("llama", "m").inc(prompt)
    m.reported_cached.labels("llama", "m").inc(cached)
    return generate_latest(m.registry).decode()


def test_the_observation_is_read_from_router_metrics() -> None:
    before = sample(metrics_text(10, 20_000, 5_000, 100), at=100.0)
    after = sample(metrics_text(70, 140_000, 65_000, 100), at=130.0)
    obs = observe(before, after)
    assert obs is not None
    assert obs.arrival_rate == pytest.approx(2.0)
    assert obs.prompt_tokens == pytest.approx(2000)
    assert obs.output_tokens == pytest.approx(100)
    assert obs.prefix_reuse == pytest.approx(0.5)
    assert observe(after, after) is None  # no traffic
    assert observe(after, before) is None  # the router restarted: counters went back


def test_a_real_router_reports_what_the_planner_needs(tmp_path: Path) -> None:
    tok = deepseek_tokenizer_dir(tmp_path / "tok")
    with serve_engines(FakeEngine("e0")) as (engine,):
        cfg = RouterConfig.model_validate(
            {
                "model": {"name": "tiny", "tokenizer": str(tok), "block_size": 16},
                "backends": [{"name": "e0", "url": engine.url}],
            }
        )
        with serve_router(cfg) as router:
            before = sample(httpx.get(f"{router.url}/metrics").text, at=0.0)
            for i in range(6):
                body = {"model": "tiny", "prompt": f"hello {i} " * 40, "max_tokens": 32}
                assert httpx.post(f"{router.url}/v1/completions", json=body).status_code == 200
            after = sample(httpx.get(f"{router.url}/metrics").text, at=3.0)
    obs = observe(before, after)
    assert obs is not None
    assert obs.arrival_rate == pytest.approx(2.0)
    assert obs.output_tokens == pytest.approx(32)
    assert 80 < obs.prompt_tokens < 200


# --- the operator hook on the real API server ------------------------------------------------


def k8s_obj(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvplane.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.mark.k8s
def test_the_hook_publishes_and_applies_the_plan(
    k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    c, ns = k8s_cluster, k8s_namespace
    c.kubectl("apply", "-f", str(CRDS))
    for plural in ("inferencepools", "prefillpools", "decodepools"):
        c.kubectl(
            "wait", "--for=condition=Established", f"crd/{plural}.kvplane.io", "--timeout=60s"
        )
    model = {"servedName": "m", "source": "s", "kvBytesPerToken": 131072}
    pool = {
        "model": model,
        "slo": {"ttftMs": 1000, "itlMs": 40},
        "planner": {"mode": "apply", "intervalSeconds": 30, "minReplicas": 2, "maxReplicas": 12},
    }
    for manifest in (
        k8s_obj("InferencePool", "llama", pool),
        k8s_obj("PrefillPool", "p", {"poolRef": {"name": "llama"}, "replicas": 1}),
        k8s_obj("DecodePool", "d", {"poolRef": {"name": "llama"}, "replicas": 1}),
    ):
        c.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(manifest))
    c.kubectl(
        "patch", "inferencepool", "llama", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"routerEndpoint": "http://llama-router:8000"}}),
    )  # fmt: skip

    # what the router's /metrics says at two scrapes 30 s apart: prefill-heavy traffic
    pages = iter([metrics_text(10, 80_000, 8_000, 150), metrics_text(130, 1_040_000, 104_000, 150)])
    now = [1000.0]

    async def scrape(endpoint: str) -> str:
        assert endpoint == "http://llama-router:8000"
        return next(pages)

    async def plan(obs: Observation, t: Targets, b: Budget, s: PlannerSetup) -> Plan:
        # in-process (the operator's runs in a worker process); the DES runs its own loop
        return await asyncio.to_thread(recommend, obs, t, b, SETUP)

    async def run() -> Plan | None:
        kube = await Kube.connect(str(c.kubeconfig))
        try:

            def objects(kind: str) -> list[Any]:  # what the operator's cache holds
                items: list[Any] = c.kubectl_json("get", kind.lower(), "-n", ns)["items"]
                return items

            hook = PlannerHook(kube, objects, scrape=scrape, plan=plan, clock=lambda: now[0])
            (item,) = objects("InferencePool")
            assert await hook.visit(item) is None  # the first scrape: nothing to compare
            now[0] += 10
            assert await hook.visit(item) is None  # before intervalSeconds: no scrape
            now[0] += 20
            out = await hook.visit(item)
            text = generate_latest(hook.metrics.registry).decode()
            assert f'kvplane_planner_meets_targets{{namespace="{ns}",pool="llama"}} 1.0' in text
            return out
        finally:
            await kube.close()

    made = asyncio.run(run())
    assert made is not None and made.meets_targets
    assert made.observed.arrival_rate == pytest.approx(4.0)
    status = c.kubectl_json("get", "inferencepool", "llama", "-n", ns)["status"]["plan"]
    assert (status["prefillReplicas"], status["decodeReplicas"]) == (made.prefill, made.decode)
    assert status["applied"] is True and status["meetsTargets"] is True
    assert "4.00 req/s" in status["observed"]
    assert made.prefill > made.decode  # prefill-heavy
    p = c.kubectl_json("get", "prefillpool", "p", "-n", ns)["spec"]
    d = c.kubectl_json("get", "decodepool", "d", "-n", ns)["spec"]
    assert (p["replicas"], d["replicas"]) == (made.prefill, made.decode)
