"""What the operator costs at rest: API requests per second and CPU, against the number
of pools, on the local control plane (support.k8s_cluster, kwok nodes).

    python tests/bench_operator_at_rest.py --pools 10 100 300
    python tests/bench_operator_at_rest.py --pools 10 100 --baseline-site DIR

For each build (this checkout, and with ``--baseline-site`` an installed older kvplane,
e.g. ``pip install --no-deps --target DIR <checkout of main>``), a fresh cluster: the
build's CRDs, ``kvplane operator`` as its own ServiceAccount, then pools added up to
each size (InferencePool + DecodePool, one router replica, spread over namespaces).
Once all are Ready and one resync period has passed, the API server's audit log counts
the operator's requests over the window, and /proc its CPU time. Prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.k8s_cluster import K8sCluster, running_cluster

from kvplane.local.ports import free_port

MODEL = {"servedName": "llama", "source": "meta-llama/Llama-3.1-8B", "kvBytesPerToken": 131072}
NAMESPACES = 10
OPERATOR_NS = "kvplane-bench"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Row:
    build: str
    pools: int
    ready_s: float
    requests_per_s: float
    writes_per_s: float
    cpu_percent: float


class Operator:
    """``kvplane operator`` of one build, as a ServiceAccount bound to cluster-admin."""

    def __init__(self, c: K8sCluster, name: str, site: Path | None, resync_s: float) -> None:
        c.kubectl("create", "serviceaccount", name, "-n", OPERATOR_NS)
        c.kubectl(
            "create", "clusterrolebinding", name, "--clusterrole=cluster-admin",
            f"--serviceaccount={OPERATOR_NS}:{name}",
        )  # fmt: skip
        self.user = f"system:serviceaccount:{OPERATOR_NS}:{name}"
        env = {
            **c.env(c.service_account_kubeconfig(OPERATOR_NS, name, duration_s=86400)),
            "KVPLANE_RESYNC_SECONDS": str(resync_s),
        }
        if site is not None:
            env["PYTHONPATH"] = str(site)
        self.log = c.workdir / "logs" / f"operator-{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvplane.cli", "--log-level", "warning", "operator",
                 "--health-port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=c.workdir,  # not the checkout, whose kvplane/ would shadow the build's
            )  # fmt: skip

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def crds_of(site: Path | None, out: Path) -> Path:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "crds", "--out", str(out)],
        check=True,
        env=env,
        capture_output=True,
        cwd=out,
    )
    return out


def add_pools(c: K8sCluster, start: int, stop: int) -> None:
    docs = []
    for i in range(start, stop):
        ns, name = f"bench-{i % NAMESPACES}", f"pool-{i}"
        docs.append(
            {
                "apiVersion": "kvplane.io/v1alpha1",
                "kind": "InferencePool",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"model": MODEL, "router": {"replicas": 1}},
            }
        )
        docs.append(
            {
                "apiVersion": "kvplane.io/v1alpha1",
                "kind": "DecodePool",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"poolRef": {"name": name}, "replicas": 1},
            }
        )
    for chunk in range(0, len(docs), 200):
        c.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs[chunk : chunk + 200]))


def ready_count(c: K8sCluster) -> int:
    pools = c.kubectl_json("get", "inferencepools", "-A")["items"]
    return sum(
        any(
            x["type"] == "Ready" and x["status"] == "True"
            for x in p.get("status", {}).get("conditions", [])
        )
        for p in pools
    )


def ready_at_least(c: K8sCluster, n: int) -> Callable[[], bool]:
    return lambda: ready_count(c) >= n


def _ts(event: dict[str, object]) -> dt.datetime:
    return dt.datetime.fromisoformat(str(event["requestReceivedTimestamp"]).replace("Z", "+00:00"))


def measure(
    c: K8sCluster, op: Operator, build: str, pools: int, ready_s: float, window_s: float
) -> Row:
    start_wall, start_cpu = dt.datetime.now(dt.UTC), op.cpu_s()
    time.sleep(window_s)
    end_wall, end_cpu = dt.datetime.now(dt.UTC), op.cpu_s()
    events = [e for e in c.audit_events(op.user) if start_wall <= _ts(e) < end_wall]
    writes = [e for e in events if e["verb"] in ("create", "update", "patch", "delete")]
    return Row(
        build,
        pools,
        ready_s,
        len(events) / window_s,
        len(writes) / window_s,
        100 * (end_cpu - start_cpu) / window_s,
    )


def run_build(
    build: str, site: Path | None, sizes: list[int], args: argparse.Namespace
) -> list[Row]:
    rows = []
    nodes = max(3, -(-max(sizes) * 4 // 100))  # 4 pods a pool, 110 pods a node
    with (
        running_cluster(gpu_nodes=nodes, gpus_per_node=64) as c,
        tempfile.TemporaryDirectory() as tmp,
    ):
        c.kubectl("apply", "-f", str(crds_of(site, Path(tmp))))
        c.kubectl(
            "wait", "--for=condition=Established", "crd/inferencepools.kvplane.io", "--timeout=60s"
        )
        for ns in [OPERATOR_NS, *(f"bench-{i}" for i in range(NAMESPACES))]:
            c.kubectl("create", "namespace", ns)
        c.wait_until(
            "the namespaces' default ServiceAccounts",
            lambda: (
                len(
                    c.kubectl_json("get", "sa", "-A", "--field-selector=metadata.name=default")[
                        "items"
                    ]
                )
                >= NAMESPACES + 1
            ),
            timeout_s=60,
        )
        op = Operator(c, "operator", site, args.resync)
        try:
            have = 0
            for size in sizes:
                began = time.monotonic()
                add_pools(c, have, size)
                have = size
                c.wait_until(
                    f"{size} pools Ready",
                    ready_at_least(c, size),
                    timeout_s=args.ready_timeout,
                    interval_s=5.0,
                )
                ready_s = time.monotonic() - began
                time.sleep(args.resync + 10)  # the first resync after the rollout
                row = measure(c, op, build, size, ready_s, args.window)
                print(
                    f"{row.build:<10} {row.pools:>5} pools  ready in {row.ready_s:6.1f} s  "
                    f"{row.requests_per_s:7.2f} req/s  {row.writes_per_s:7.2f} writes/s  "
                    f"{row.cpu_percent:5.1f}% CPU",
                    flush=True,
                )
                rows.append(row)
        except Exception:
            print(op.log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            op.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, nargs="+", default=[10, 100, 300])
    parser.add_argument("--baseline-site", type=Path, help="an older kvplane on PYTHONPATH")
    parser.add_argument("--resync", type=float, default=30.0, help="KVPLANE_RESYNC_SECONDS")
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured at rest")
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    args = parser.parse_args()
    sizes = sorted(args.pools)
    rows = []
    if args.baseline_site is not None:
        rows += run_build("baseline", args.baseline_site, sizes, args)
    rows += run_build("this", None, sizes, args)
    print(f"\nresync {args.resync:g} s, window {args.window:g} s")
    print("build       pools  ready (s)   req/s  writes/s  CPU %  req/s per pool")
    for r in rows:
        print(
            f"{r.build:<10} {r.pools:>6} {r.ready_s:10.1f} {r.requests_per_s:7.2f} "
            f"{r.writes_per_s:9.2f} {r.cpu_percent:6.1f} {r.requests_per_s / r.pools:10.4f}"
        )
    print(json.dumps([r.__dict__ for r in rows]))


if __name__ == "__main__":
    main()
