"""Every dashboard panel's query, run on a real Prometheus (Debian's ``prometheus``,
installed by scripts/setup-apt.sh) that scrapes a running stack under bounded traffic:

- pool ``agg``: two simulated vLLM engines with a small GPU cache and a CPU tier (so
  blocks are evicted, offloaded and loaded back), a third engine that answers 500 (so the
  router retries), a router over a real Redis index and a standalone ``kvplane indexer``;
- pool ``pd``: simulated NIXL prefill/decode engines behind a P/D router, plus a prefill
  pod that answers 500 (so a prefill leg fails for real).

Each query of the router, vLLM, P/D and tier dashboards must return a finite value;
the SGLang dashboard's queries (no SGLang engine runs here) must be accepted. So must
the queries of the shipped Prometheus adapter rules (the autoscaling signals). The
``pod`` label of engine series comes from the scrape configuration, as a PodMonitor's
target label would; the routers are scraped with ``honor_labels`` so that their own
``pod`` label (the backend) wins, as the chart's PodMonitor does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from kvplane.operator.render.autoscaling import prometheus_adapter_config
from kvplane.router.config import RouterConfig
from support.fake_engine import FakeEngine, serve_engines
from support.k8s_cluster import K8sCluster
from support.processes import built_tool, logged_process, tail
from support.redis_server import RedisServer
from support.router_server import RunningRouter, deepseek_tokenizer_dir, serve_router

from kvplane.local.ports import free_port
from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet
from kvplane.workload.text import shared_prefix_workload

pytestmark = [pytest.mark.redis]

REPO = Path(__file__).resolve().parents[1]
BOARDS = REPO / "charts" / "kvplane" / "dashboards"
SCRAPE_S = 1
RATE_WINDOW = "30s"
NAMESPACE = "kvplane-test"
ROUNDS = 12  # traffic rounds at most (each a few dozen requests): the load is bounded
Json = dict[str, Any]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("Debian's prometheus is not installed (scripts/setup-apt.sh installs it)")
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def router_config(fleet: SimFleet, tok: Path, pool: str, **extra: Any) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tok),
                "block_size": fleet.profile.block_size,
                "max_model_len": 8192,
                "kv_bytes_per_token": fleet.profile.kv_bytes_per_token,
            },
            "pool": pool,
            "scrape_interval_s": 0.5,
            **extra,
        }
    )


@contextlib.contextmanager
def indexer_process(config: RouterConfig, tmp: Path) -> Iterator[int]:
    path = tmp / "indexer.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    port = free_port()
    cmd = [sys.executable, "-m", "kvplane.cli", "indexer", "--config", str(path)]
    with logged_process([*cmd, "--metrics-port", str(port)], tmp / "indexer.log", cwd=tmp):
        yield port


@contextlib.contextmanager
def prometheus(binary: str, tmp: Path, jobs: list[Json]) -> Iterator[str]:
    port = free_port()
    cfg = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "5s"}}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({**cfg, "scrape_configs": jobs}))
    argv = [
        binary,
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    url = f"http://127.0.0.1:{port}"
    log = tmp / "prometheus.log"
    with logged_process(argv, log, cwd=tmp) as proc:

        def ready() -> bool:
            assert proc.poll() is None, tail(log, 2000)
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
            return False

        wait_until(ready, 60, "Prometheus to be ready")
        yield url


def job(name: str, targets: dict[str, str], honor: bool = False) -> Json:
    """A scrape job; ``targets`` maps the pod label to host:port. Every target is in one
    namespace, as a PodMonitor's would carry theirs."""
    return {
        "job_name": name,
        "honor_labels": honor,
        "static_configs": [
            {"targets": [t], "labels": {"pod": p, "namespace": NAMESPACE}}
            for p, t in targets.items()
        ],
    }


def hostport(url: str) -> str:
    return url.removeprefix("http://")


async def _traffic(url: str, prompts: list[str]) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    sem = asyncio.Semaphore(4)

    async def one(prompt: str) -> None:
        async with sem:
            with contextlib.suppress(openai.OpenAIError):
                stream = await client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for _ in stream:
                    pass

    await asyncio.gather(*(one(p) for p in prompts))
    await client.close()


def traffic_round(routers: list[RunningRouter], round_: int) -> None:
    """Three sets of shared prefixes in turn: each comes back after the other two
    pushed it out of the engines' GPU cache into their CPU tier."""
    for i, r in enumerate(routers):
        work = shared_prefix_workload(4, 4, 250, 16, round_ % 3 * 10 + i)
        asyncio.run(_traffic(r.url, [w.prompt for w in work]))


def panel_queries(board: Json) -> list[tuple[str, str]]:
    """(panel title, PromQL) with the dashboard's variables at 'All'."""
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var in ("$pool", "$model"):
                expr = expr.replace(var, ".*")
            expr = expr.replace("$__rate_interval", RATE_WINDOW)
            out.append((panel["title"], expr))
    return out


def query(prom: str, expr: str) -> Json:
    resp = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body: Json = resp.json()
    assert body.get("status") == "success", f"{expr}: {body}"
    return body


def has_value(body: Json) -> bool:
    data = body["data"]
    if data["resultType"] == "scalar":
        return math.isfinite(float(data["result"][1]))
    return any(math.isfinite(float(s["value"][1])) for s in data["result"])


@dataclass
class Stack:
    prometheus: str
    routers: list[RunningRouter]
    engine_pods: list[str]


@pytest.fixture(scope="module")
def stack(
    prometheus_bin: str,
    redis_server: RedisServer,
    tokenizer_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    tmp_path = tmp_path_factory.mktemp("stack")
    agg_cfg = FleetConfig(
        tokenizer=str(tokenizer_dir),
        engines=2,
        model="tiny",
        profile="cpu-tiny",
        num_gpu_blocks=64,  # fewer than the three prefix sets: evicted, offloaded, loaded
        cpu_offload_blocks=2048,
        names=("e0", "e1"),
    )
    pd_cfg = FleetConfig(
        tokenizer=str(tokenizer_dir),
        engines=4,
        model="tiny",
        profile="cpu-tiny",
        roles=("prefill", "prefill", "decode", "decode"),
        kv_connector="nixl",
        names=("p0", "p1", "d0", "d1"),
    )
    faulty, faulty_prefill = FakeEngine("faulty", mode="fail500"), FakeEngine("pf", mode="fail500")
    redis_url = f"{redis_server.url}/7"
    with contextlib.ExitStack() as es:
        agg = es.enter_context(running_fleet(agg_cfg))
        pd = es.enter_context(running_fleet(pd_cfg))
        es.enter_context(serve_engines(faulty, faulty_prefill))
        agg_router_cfg = router_config(
            agg,
            tokenizer_dir,
            "agg",
            backends=[*agg.backends(), {"name": "faulty", "url": faulty.url}],
            index={"backend": "redis", "url": redis_url},
        )
        indexer_cfg = router_config(
            agg, tokenizer_dir, "agg", backends=agg.backends(), index=agg_router_cfg.index
        )
        indexer_port = es.enter_context(indexer_process(indexer_cfg, tmp_path))
        agg_router = es.enter_context(serve_router(agg_router_cfg, embedded_indexer=False))
        link = {"bandwidth_gbps": pd_cfg.pd_link_gbps, "latency_ms": 0.0}
        pd_router = es.enter_context(
            serve_router(
                router_config(
                    pd,
                    tokenizer_dir,
                    "pd",
                    backends=[
                        {"name": "pf", "url": faulty_prefill.url, "role": "prefill"},
                        *pd.backends(),
                    ],
                    pd={
                        "connector": "nixl",
                        "aggregate_max_uncached_tokens": 32,
                        "links": {"same_node": link, "same_zone": link, "cross_zone": link},
                    },
                )
            )
        )
        engines = {e.cfg.name: hostport(e.url) for e in [*agg.engines, *pd.engines]}
        jobs = [
            job("kvplane-router", {"router-agg": hostport(agg_router.url)}, honor=True),
            job("kvplane-router-pd", {"router-pd": hostport(pd_router.url)}, honor=True),
            job("kvplane-indexer", {"indexer-agg": f"127.0.0.1:{indexer_port}"}),
            job("engines", engines),
        ]
        prom = es.enter_context(prometheus(prometheus_bin, tmp_path, jobs))

        def targets_up() -> bool:
            body = query(prom, "up")
            return len(body["data"]["result"]) == len(engines) + 3 and all(
                s["value"][1] == "1" for s in body["data"]["result"]
            )

        wait_until(targets_up, 60, "every scrape target to be up")
        yield Stack(prom, [agg_router, pd_router], list(engines))


def until_all_have_data(st: Stack, queries: set[tuple[str, str, str]]) -> None:
    """Bounded rounds of traffic until every query returns a finite value."""
    pending = set(queries)
    for rounds in range(1, ROUNDS + 1):
        pending = {p for p in pending if not has_value(query(st.prometheus, p[2]))}
        if not pending:
            return
        traffic_round(st.routers, rounds)
        time.sleep(2 * SCRAPE_S)  # the round's last samples reach Prometheus
    pending = {p for p in pending if not has_value(query(st.prometheus, p[2]))}
    missing = "\n".join(f"{n}: {t}: {e}" for n, t, e in sorted(pending))
    assert not pending, f"after {ROUNDS} rounds, without data:\n{missing}"


def test_every_panel_returns_data_on_a_real_prometheus(stack: Stack) -> None:
    boards = {p.stem: json.loads(p.read_text()) for p in sorted(BOARDS.glob("*.json"))}
    assert {"router", "engines", "engines-sglang", "pd", "tiers"} <= set(boards)
    accepted_only = {"engines-sglang"}
    queries = {
        (name, title, expr)
        for name, board in boards.items()
        for title, expr in panel_queries(board)
    }
    for _, _, expr in sorted(queries):
        query(stack.prometheus, expr)  # every query parses and runs
    until_all_have_data(stack, {q for q in queries if q[0] not in accepted_only})


def adapter_query(rule: Json, series: str, matchers: str, group_by: str) -> str:
    """A Prometheus adapter rule's metricsQuery as the adapter expands its template."""
    template: str = rule["metricsQuery"]
    return (
        template.replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", group_by)
    )


def test_the_prometheus_adapter_rules_read_kvplane_signals(stack: Stack) -> None:
    """Each rule of the shipped adapter config finds its series (seriesQuery) and its
    query gives a value: per pod for the vLLM engines' gauges, per pool for the
    router's predicted TTFT p90 (SGLang's rules: accepted)."""
    cfg = prometheus_adapter_config()
    queries = set()
    for rule in cfg["rules"]:
        metric = rule["name"]["matches"].strip("^$")
        series = httpx.get(
            f"{stack.prometheus}/api/v1/series", params={"match[]": rule["seriesQuery"]}, timeout=10
        ).json()
        assert series["status"] == "success", series
        pods = "|".join(stack.engine_pods)
        expr = adapter_query(rule, metric, f'namespace="{NAMESPACE}",pod=~"{pods}"', "pod")
        if metric.startswith("vllm:"):
            assert series["data"], rule["seriesQuery"]
            queries.add(("adapter", rule["name"]["as"], expr))
        else:
            query(stack.prometheus, expr)
    (ext,) = cfg["externalRules"]
    for pool in ("agg", "pd"):
        expr = adapter_query(
            ext,
            ext["name"]["matches"].strip("^$"),
            f'namespace="{NAMESPACE}",pool="{pool}"',
            "namespace",
        )
        queries.add(("adapter", f"{ext['name']['as']} {pool}", expr))
    until_all_have_data(stack, queries)


@pytest.fixture(scope="module")
def adapter_bin() -> str:
    return built_tool("setup-prometheus-adapter.sh", timeout_s=1800)


METRICS_READER = """
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: kvplane-test-metrics-reader}
rules:
- apiGroups: [custom.metrics.k8s.io, external.metrics.k8s.io]
  resources: ["*"]
  verbs: [get, list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kvplane-test-metrics-reader}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kvplane-test-metrics-reader}
subjects:
- {kind: ServiceAccount, name: hpa-reader, namespace: %(ns)s}
"""


def parse_quantity(q: str) -> float:
    """A Kubernetes quantity as the metrics APIs write values ("1500m", "2", "3k")."""
    units = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    return float(q[:-1]) * units[q[-1]] if q[-1] in units else float(q)


@pytest.mark.k8s
def test_the_prometheus_adapter_serves_kvplane_signals(
    stack: Stack, adapter_bin: str, k8s_cluster: K8sCluster, tmp_path: Path
) -> None:
    """The adapter (built from the Go module proxy) with the chart's rules, on the real
    control plane and the real Prometheus, answers the metrics API requests an HPA makes:
    the router's predicted TTFT p90 per pool (external) and the engines' queue depth per
    pod (custom). The local control plane has no aggregation layer, so the requests go
    to the adapter itself, authenticated as a ServiceAccount allowed to read metrics."""
    c = k8s_cluster
    c.kubectl("create", "namespace", NAMESPACE, check=False)
    for name in stack.engine_pods:  # the pods the custom metrics describe
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "engine"}},
            "spec": {"containers": [{"name": "e", "image": "engine"}]},
        }
        c.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(pod))
    c.kubectl("create", "serviceaccount", "hpa-reader", "-n", NAMESPACE, check=False)
    c.kubectl("apply", "-f", "-", input=METRICS_READER % {"ns": NAMESPACE})
    token = c.create_token(NAMESPACE, "hpa-reader")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(prometheus_adapter_config()))
    port = free_port()
    kc = str(c.kubeconfig)
    argv = [
        adapter_bin,
        f"--prometheus-url={stack.prometheus}",
        f"--config={tmp_path / 'config.yaml'}",
        "--metrics-relist-interval=2s",
        f"--lister-kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--authentication-tolerate-lookup-failure",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={tmp_path / 'certs'}",
    ]
    log = tmp_path / "adapter.log"
    base = f"https://127.0.0.1:{port}/apis"
    auth = {"Authorization": f"Bearer {token}"}
    with logged_process(argv, log) as proc:

        def items(path: str) -> list[Json]:
            assert proc.poll() is None, tail(log)
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{base}/{path}", headers=auth, verify=False, timeout=10)
                if r.status_code == 200:
                    out: list[Json] = r.json().get("items", [])
                    return out
            return []

        ttft = (
            f"external.metrics.k8s.io/v1beta1/namespaces/{NAMESPACE}/"
            "kvplane_router_predicted_ttft_p90_seconds?labelSelector=pool%3Dagg"
        )
        queue = (
            f"custom.metrics.k8s.io/v1beta1/namespaces/{NAMESPACE}/pods/*/vllm_num_requests_waiting"
        )
        got: dict[str, list[Json]] = {}
        for rounds in range(1, ROUNDS + 1):
            got = {"ttft": items(ttft), "queue": items(queue)}
            if all(got.values()):
                break
            traffic_round(stack.routers, rounds)
        assert got["ttft"], tail(log)
        (value,) = got["ttft"]
        assert value["metricName"] == "kvplane_router_predicted_ttft_p90_seconds"
        assert 0 < parse_quantity(value["value"]) < 30  # seconds, as the HPA compares it
        pods = {i["describedObject"]["name"] for i in got["queue"]}
        assert {"e0", "e1"} <= pods


# --- Grafana's dashboard schema ----------------------------------------------------------------
# No Grafana server can be had here (not in Debian; its frontend build is out of reach), so
# the dashboards are checked against Grafana's own published schema: @grafana/schema's
# Dashboard type (generated from Grafana's CUE dashboard kind), by the TypeScript compiler,
# each dashboard an object literal that must satisfy it (unknown keys and wrong types fail;
# enum types are compared by their string values, as JSON holds them).

CHECK_TS = """\
import type {{ Dashboard }} from "{types}";
type J<T> = T extends string ? `${{T}}` : T extends Array<infer U> ? Array<J<U>>
  : T extends object ? {{ [K in keyof T]: J<T[K]> }} : T;
{boards}
"""


@pytest.fixture(scope="module")
def schema_dir() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup-dashboard-schema.sh")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    if not proc.stdout.strip():
        pytest.skip(proc.stderr.strip())
    return Path(proc.stdout.strip())


def typecheck(schema: Path, boards: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    types = schema / "node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen"
    body = "\n".join(
        f"export const {n.replace('-', '_')} = {text.strip()} satisfies J<Dashboard>;"
        for n, text in boards.items()
    )
    src = tmp / "check.ts"
    src.write_text(CHECK_TS.format(types=types, boards=body))
    tsc = schema / "node_modules/typescript/bin/tsc"
    return subprocess.run(
        ["node", str(tsc), "--noEmit", "--strict", str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dashboards_satisfy_grafanas_dashboard_schema(schema_dir: Path, tmp_path: Path) -> None:
    boards = {p.stem: p.read_text() for p in sorted(BOARDS.glob("*.json"))}
    proc = typecheck(schema_dir, boards, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the check does reject what Grafana's schema rejects
    bad = json.loads(boards["router"])
    bad["graphTooltip"] = "shared"
    bad["panels"][1]["gridPoz"] = bad["panels"][1].pop("gridPos")
    proc = typecheck(schema_dir, {"bad": json.dumps(bad)}, tmp_path)
    assert proc.returncode != 0
    assert "graphTooltip" in proc.stdout or "DashboardCursorSync" in proc.stdout
    assert "gridPoz" in proc.stdout
