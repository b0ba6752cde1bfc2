"""Autoscaling as shipped: the HPAs the operator renders for each signal (engine queue
depth and KV cache usage by the engine adapters' own metric names, the router's
predicted TTFT against the pool's SLO), the Prometheus adapter rules that serve them
(generated, shipped by the chart), and the objects accepted by a real kube-apiserver.
The rules' queries run on a real Prometheus in tests/test_dashboards.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvplane.operator.api import Engine, EnginePoolSpec, InferencePoolSpec, ScaleSignal
from kvplane.operator.render import names
from kvplane.operator.render.autoscaling import (
    PREDICTED_TTFT_METRIC,
    hpa_metric_name,
    prometheus_adapter_config,
)
from kvplane.operator.render.engine import engine_autoscaler
from kvplane.operator.render.engines import adapter
from support.k8s_cluster import K8sCluster

from kvplane.types import Json

REPO = Path(__file__).resolve().parents[1]
ADAPTER_FILE = REPO / "charts" / "kvplane" / "files" / "prometheus-adapter.yaml"
CRDS = REPO / "crds"
MODEL = {"servedName": "llama", "source": "meta-llama/Llama-3.1-8B", "kvBytesPerToken": 131072}


def ipool(kind: str = "vllm", **extra: Any) -> InferencePoolSpec:
    return InferencePoolSpec.model_validate({"model": MODEL, "engine": {"kind": kind}, **extra})


def scaled(signal: str, target: float | None = None) -> EnginePoolSpec:
    auto: dict[str, Any] = {"minReplicas": 1, "maxReplicas": 8, "signal": signal}
    if target is not None:
        auto["target"] = target
    return EnginePoolSpec.model_validate({"poolRef": {"name": "llama"}, "autoscaling": auto})


def hpa(
    pool: InferencePoolSpec, spec: EnginePoolSpec, role: names.Role = names.Role.DECODE
) -> Json:
    out = engine_autoscaler("llama", "ns", pool, "d", role, spec)
    assert out is not None
    return out


@pytest.mark.parametrize("kind", list(Engine))
def test_engine_signals_are_the_engines_own_metrics(kind: Engine) -> None:
    """Each engine signal reads the engine's own gauge (as the engine names it), under
    the adapter's colon-free name."""
    own = {
        Engine.VLLM: {
            "kvCachePressure": "vllm:kv_cache_usage_perc",
            "queueDepth": "vllm:num_requests_waiting",
        },
        Engine.SGLANG: {
            "kvCachePressure": "sglang:token_usage",
            "queueDepth": "sglang:num_queue_reqs",
        },
    }[kind]
    for signal, metric in own.items():
        assert adapter(kind).scale_metrics[ScaleSignal(signal)] == metric
        (m,) = hpa(ipool(kind.value), scaled(signal, 4))["spec"]["metrics"]
        assert m["type"] == "Pods"
        assert m["pods"]["metric"]["name"] == metric.replace(":", "_")
        assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": "4000m"}


def test_predicted_ttft_is_held_at_the_pools_slo() -> None:
    with_slo = ipool(slo={"ttftMs": 800, "itlMs": 40})
    (m,) = hpa(with_slo, scaled("predictedTTFT"), names.Role.PREFILL)["spec"]["metrics"]
    assert m["type"] == "External"
    ext = m["external"]
    assert ext["metric"] == {
        "name": PREDICTED_TTFT_METRIC,
        "selector": {"matchLabels": {"pool": "llama"}},  # the router's pool label
    }
    assert ext["target"] == {"type": "Value", "value": "800m"}  # seconds
    # without an SLO the pool's own target (seconds)
    (m,) = hpa(ipool(), scaled("predictedTTFT", 1.5))["spec"]["metrics"]
    assert m["external"]["target"]["value"] == "1500m"


def test_adapter_rules_serve_every_rendered_metric() -> None:
    cfg = prometheus_adapter_config()
    served = {r["name"]["as"]: r for r in cfg["rules"]}
    for kind in Engine:
        for metric in adapter(kind).scale_metrics.values():
            rule = served[hpa_metric_name(metric)]
            assert f'__name__="{metric}"' in rule["seriesQuery"]
            assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    (ttft,) = cfg["externalRules"]
    assert ttft["name"]["as"] == PREDICTED_TTFT_METRIC
    assert "histogram_quantile(0.9" in ttft["metricsQuery"]
    assert "kvplane_router_predicted_ttft_seconds_bucket" in ttft["seriesQuery"]


def test_the_chart_ships_the_generated_adapter_rules() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "adapter-rules"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout
    assert ADAPTER_FILE.read_text() == out, (
        "stale: kvplane adapter-rules > charts/kvplane/files/prometheus-adapter.yaml"
    )
    assert yaml.safe_load(out) == prometheus_adapter_config()


# --- on the real control plane ----------------------------------------------------------------


def create(cluster: K8sCluster, ns: str, manifest: Json) -> tuple[bool, str]:
    out = cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(manifest), check=False)
    return out.returncode == 0, out.stderr


@pytest.mark.k8s
def test_the_api_server_accepts_the_autoscaling_objects(
    k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    c, ns = k8s_cluster, k8s_namespace
    c.kubectl("apply", "-f", str(CRDS))
    c.kubectl(
        "wait", "--for=condition=Established", "crd/inferencepools.kvplane.io", "--timeout=60s"
    )
    pool = {
        "model": MODEL,
        "slo": {"ttftMs": 800, "itlMs": 40},
        "planner": {"mode": "apply", "minReplicas": 2, "maxReplicas": 8},
    }
    manifest = {
        "apiVersion": "kvplane.io/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "llama"},
        "spec": pool,
    }
    ok, err = create(c, ns, manifest)
    assert ok, err
    got = c.kubectl_json("get", "inferencepool", "llama", "-n", ns)["spec"]
    assert got["planner"]["intervalSeconds"] == 120 and got["slo"]["ttftMs"] == 800
    without = {k: v for k, v in pool.items() if k != "slo"}
    no_slo = {**manifest, "metadata": {"name": "no-slo"}, "spec": without}
    ok, err = create(c, ns, no_slo)
    assert not ok and "the planner needs slo" in err
    spec = InferencePoolSpec.model_validate(pool)
    for signal in ("kvCachePressure", "queueDepth", "predictedTTFT"):
        obj = engine_autoscaler(
            f"llama-{signal.lower()}", ns, spec, "d", names.Role.DECODE, scaled(signal, 2)
        )
        assert obj is not None
        ok, err = create(c, ns, obj)
        assert ok, err
        stored = c.kubectl_json("get", "hpa", obj["metadata"]["name"], "-n", ns)
        (want,), (got_m,) = obj["spec"]["metrics"], stored["spec"]["metrics"]
        kind = want["type"].lower()  # quantities come back canonical ("2000m" -> "2")
        assert got_m["type"] == want["type"]
        assert got_m[kind]["metric"] == want[kind]["metric"]
