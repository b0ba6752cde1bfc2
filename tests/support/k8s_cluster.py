"""A real, offline Kubernetes control plane for tests (no Docker, no kubelet).

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as local processes on
free loopback ports; kwok plays the kubelet of fake nodes, so scheduled pods become
Running (nothing executes in them). The binaries come from ``scripts/setup-k8s.sh``.

Auth: the API server serves TLS with a throw-away CA; the admin is a static bearer token
in group ``system:masters``; authorization is ``Node,RBAC``; ServiceAccount tokens come
from the TokenRequest API (``create_token``), so tests can run a client with exactly the
RBAC of a ServiceAccount (``service_account_kubeconfig``). See docs/k8s-test-env.md.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvplane.local.ports import free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup-k8s.sh"
TOOLS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
)

SERVICE_CIDR = "10.96.0.0/16"
# Never advertise a loopback address: the "kubernetes" Service endpoints would fail
# validation. Nothing connects to this address; it only fills those endpoints.
ADVERTISE_ADDRESS = "10.0.0.254"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"

# Controllers the tests need; the rest of kube-controller-manager stays off (2 cores).
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "job-controller",
    "cronjob-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    # removes the not-ready taint that TaintNodesByCondition puts on new nodes
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    "disruption-controller",
    "resourcequota-controller",
    "ttl-after-finished-controller",
    "service-cidr-controller",
    "certificatesigningrequest-signing-controller",
    "certificatesigningrequest-approving-controller",
    "certificatesigningrequest-cleaner-controller",
)


# Metadata of every request but the admin's (the control plane components and kwok run as
# the admin): tests count what an operator running as a ServiceAccount asked for.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    users: [kvplane-admin, "system:apiserver"]
  - level: None
    userGroups: ["system:nodes"]
  - level: Metadata
"""


class K8sError(RuntimeError):
    """The control plane could not be built, started or used."""


def find_bin_dir() -> Path:
    """The directory with the control-plane binaries, without building anything.

    ``KVPLANE_K8S_BIN`` overrides; otherwise ``scripts/setup-k8s.sh --check`` says where
    the up-to-date build is, or that there is none yet.
    """
    override = os.environ.get("KVPLANE_K8S_BIN")
    if override:
        bin_dir = Path(override)
    else:
        proc = subprocess.run(
            ["bash", str(SETUP_SCRIPT), "--check"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise K8sError(
                "Kubernetes test binaries are missing or stale: run scripts/setup-k8s.sh "
                f"(first build ~12 min on 2 cores).\n{proc.stderr.strip()}"
            )
        bin_dir = Path(proc.stdout.strip().splitlines()[-1])
    missing = [t for t in TOOLS if not os.access(bin_dir / t, os.X_OK)]
    if missing:
        raise K8sError(f"{bin_dir} lacks {', '.join(missing)}: run scripts/setup-k8s.sh")
    return bin_dir


# --- PKI (openssl CLI) -----------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise K8sError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def _make_pki(pki: Path) -> None:
    """CA, API-server serving cert and the ServiceAccount signing key pair."""
    if shutil.which("openssl") is None:
        raise K8sError("openssl not found (Debian package 'openssl')")
    pki.mkdir(parents=True)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7",
        "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=kvplane-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=pki,
    )  # fmt: skip
    (pki / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,"
        f"IP:127.0.0.1,IP:10.96.0.1,IP:{ADVERTISE_ADDRESS}\n"
    )
    _openssl(
        "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key",
        "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "7", "-extfile", "apiserver.ext", "-out", "apiserver.crt",
        cwd=pki,
    )  # fmt: skip


def _kubeconfig(server: str, ca_pem: bytes, token: str, user: str, namespace: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "kvplane-test",
                    "cluster": {
                        "server": server,
                        "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                    },
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": user,
                    "context": {"cluster": "kvplane-test", "user": user, "namespace": namespace},
                }
            ],
            "current-context": user,
        },
        sort_keys=False,
    )


# --- processes ------------------------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child after fork
    """PR_SET_PDEATHSIG: a killed pytest does not leave the control plane running."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@dataclass
class _Component:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    args: list[str] = field(default_factory=list)
    home: Path | None = None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _http_ok(url: str, *, ctx: ssl.SSLContext | None = None, token: str | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _probe(url: str, ctx: ssl.SSLContext | None) -> Callable[[], bool]:
    return lambda: _http_ok(url, ctx=ctx)


def _insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


# --- the cluster ----------------------------------------------------------------------


@dataclass
class K8sCluster:
    """A running control plane. ``kubeconfig`` is the admin's (``system:masters``)."""

    bin_dir: Path
    workdir: Path
    server: str
    kubeconfig: Path
    ca_file: Path
    admin_token: str
    version: str = ""
    gpu_nodes: list[str] = field(default_factory=list)
    cpu_nodes: list[str] = field(default_factory=list)
    _components: list[_Component] = field(default_factory=list, repr=False)
    _node_count: int = field(default=0, repr=False)

    # -- processes

    def start_component(self, name: str, args: Sequence[str], *, home: Path | None = None) -> None:
        """Start ``bin_dir/args[0]`` in its own process group, logging to ``logs/<name>.log``."""
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(exist_ok=True)
        env = dict(os.environ)
        if home is not None:
            env["HOME"] = str(home)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(self.bin_dir / args[0]), *args[1:]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self._components.append(_Component(name, proc, log, list(args), home))

    def restart_component(self, name: str, timeout_s: float = 10.0) -> None:
        """Stop one component (SIGTERM to its group, SIGKILL after ``timeout_s``) and
        start it again with the same arguments; the caller waits for it to be ready
        (``wait_api_ready`` for the API server)."""
        old = self.component(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.proc.pid, signal.SIGTERM)
        try:
            old.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.proc.pid, signal.SIGKILL)
            old.proc.wait(10)
        index = self._components.index(old)
        self._components.remove(old)
        self.start_component(name, old.args, home=old.home)
        self._components.insert(index, self._components.pop())

    def wait_api_ready(self, timeout_s: float = 120.0) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        self.wait_until(
            "kube-apiserver /readyz",
            lambda: _http_ok(f"{self.server}/readyz", ctx=ctx, token=self.admin_token),
            timeout_s=timeout_s,
            component="kube-apiserver",
            interval_s=0.2,
        )

    # -- the audit log

    @property
    def audit_log(self) -> Path:
        """Every request of a user other than the admin (the control plane's own
        components use the admin kubeconfig), one JSON event per line."""
        return self.workdir / "logs" / "audit.log"

    def audit_events(self, user: str | None = None) -> list[dict[str, Any]]:
        """The audit log's events (one per request: stage ResponseComplete, or
        ResponseStarted for a watch that has not ended), of ``user`` if given."""
        if not self.audit_log.exists():
            return []
        by_id: dict[str, dict[str, Any]] = {}
        for line in self.audit_log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            if user is not None and event.get("user", {}).get("username") != user:
                continue
            by_id[event["auditID"]] = event
        return list(by_id.values())

    def component(self, name: str) -> _Component:
        for c in self._components:
            if c.name == name:
                return c
        raise KeyError(name)

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last lines of a component's log (etcd, kube-apiserver, ..., kwok)."""
        return _tail(self.workdir / "logs" / f"{name}.log", lines)

    def wait_until(
        self,
        what: str,
        check: Callable[[], bool],
        *,
        timeout_s: float,
        component: str | None = None,
        interval_s: float = 0.2,
    ) -> None:
        """Poll ``check`` until true; fail early if a component died, with its log tail."""
        deadline = time.monotonic() + timeout_s
        while True:
            for c in self._components:
                rc = c.proc.poll()
                if rc is not None:
                    raise K8sError(
                        f"{c.name} exited with {rc} while waiting for {what}; "
                        f"log {c.log}:\n{_tail(c.log)}"
                    )
            if check():
                return
            if time.monotonic() > deadline:
                tail = (
                    f"; log tail of {component}:\n{self.log_tail(component)}" if component else ""
                )
                raise K8sError(f"timed out after {timeout_s:.0f} s waiting for {what}{tail}")
            time.sleep(interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop in reverse start order (etcd last, or the API server hangs on shutdown):
        SIGTERM to the process group, SIGKILL after ``timeout_s``. Takes ~1-2 s."""
        for c in reversed(self._components):
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
                try:
                    c.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(c.proc.pid, signal.SIGKILL)
                    c.proc.wait(10)
        self._components.clear()

    # -- clients

    @contextlib.contextmanager
    def activated(self, kubeconfig: Path | None = None) -> Iterator[Path]:
        """Point in-process clients (kopf, ``kvplane.router.kube``) at this cluster:
        ``KUBECONFIG`` for the duration, then restored. Where the sync ``kubernetes``
        package is installed (kopf then logs in through it), its
        ``KUBE_CONFIG_DEFAULT_LOCATION`` too: it reads KUBECONFIG once, at import."""
        path = kubeconfig or self.kubeconfig
        old_env = os.environ.get("KUBECONFIG")
        kube_config: Any = sys.modules.get("kubernetes.config.kube_config")
        old_default = getattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", None)
        os.environ["KUBECONFIG"] = str(path)
        if kube_config is not None:
            kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(path)
        try:
            yield path
        finally:
            if old_env is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = old_env
            if kube_config is not None:
                kube_config.KUBE_CONFIG_DEFAULT_LOCATION = old_default

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """Environment for kubectl/helm/kopf subprocesses: KUBECONFIG, PATH, private caches."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["KUBECACHEDIR"] = str(self.workdir / "kube-cache")
        for var, sub in (
            ("HELM_CACHE_HOME", "cache"),
            ("HELM_CONFIG_HOME", "config"),
            ("HELM_DATA_HOME", "data"),
        ):
            env[var] = str(self.workdir / "helm" / sub)
        return env

    def run_tool(
        self,
        tool: str,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout_s: float = 60.0,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a binary from ``bin_dir`` against this cluster; raise K8sError on failure."""
        proc = subprocess.run(
            [str(self.bin_dir / tool), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self.env(kubeconfig),
            check=False,
        )
        if check and proc.returncode != 0:
            raise K8sError(
                f"{tool} {' '.join(args)} exited {proc.returncode}:\n"
                f"{proc.stderr.strip()}\n{proc.stdout.strip()}"
            )
        return proc

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout_s: float = 60.0,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl ARGS`` as admin (or with ``kubeconfig``)."""
        return self.run_tool(
            "kubectl", *args, input=input, check=check, timeout_s=timeout_s, kubeconfig=kubeconfig
        )

    def kubectl_json(self, *args: str, kubeconfig: Path | None = None) -> Any:
        """``kubectl ARGS -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def apply(self, manifest: Mapping[str, Any] | str, *, namespace: str | None = None) -> None:
        """``kubectl apply -f -`` of a dict (sent as JSON) or YAML text."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=text)

    def helm(
        self, *args: str, check: bool = True, timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """``helm ARGS`` as admin, with helm's cache/config/data dirs inside the workdir."""
        return self.run_tool("helm", *args, check=check, timeout_s=timeout_s)

    def kubeconfig_for_token(
        self, token: str, *, name: str = "token", namespace: str = "default"
    ) -> Path:
        """Write a kubeconfig that authenticates with ``token``; returns its path."""
        path = self.workdir / "kubeconfigs" / f"{name}-{secrets.token_hex(3)}.yaml"
        path.parent.mkdir(exist_ok=True)
        ca_pem = self.ca_file.read_bytes()
        path.write_text(_kubeconfig(self.server, ca_pem, token, name, namespace))
        path.chmod(0o600)
        return path

    def create_token(
        self,
        namespace: str,
        service_account: str,
        *,
        duration_s: int = 3600,
        audiences: Sequence[str] = (),
    ) -> str:
        """A bound ServiceAccount token from the TokenRequest API (``kubectl create token``)."""
        aud = [f"--audience={a}" for a in audiences]
        out = self.kubectl(
            "create", "token", service_account, "-n", namespace,
            f"--duration={duration_s}s", *aud,
        ).stdout  # fmt: skip
        return out.strip()

    def service_account_kubeconfig(
        self, namespace: str, service_account: str, *, duration_s: int = 3600
    ) -> Path:
        """A kubeconfig acting as ``system:serviceaccount:<namespace>:<service_account>``."""
        token = self.create_token(namespace, service_account, duration_s=duration_s)
        return self.kubeconfig_for_token(
            token, name=f"{namespace}-{service_account}", namespace=namespace
        )

    # -- nodes

    def add_node(
        self,
        name: str,
        *,
        gpus: int = 0,
        zone: str = "zone-a",
        cpu: str = "64",
        memory: str = "512Gi",
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        wait: bool = True,
    ) -> None:
        """Create a kwok-managed fake node (``gpus`` > 0: nvidia.com/gpu capacity + labels).

        Each node gets its own pod CIDR 10.244.<n>.0/24 and InternalIP 10.0.0.<n+1>; kwok
        hands pod IPs out of that CIDR. Nothing listens on these IPs.
        """
        self._node_count += 1
        n = self._node_count
        capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
        node_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "topology.kubernetes.io/region": "kvplane-test",
            "topology.kubernetes.io/zone": zone,
        }
        if gpus:
            capacity[GPU_RESOURCE] = str(gpus)
            node_labels |= {
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": GPU_PRODUCT,
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": "81559",
                "node.kubernetes.io/instance-type": f"fake-h100x{gpus}",
            }
        node_labels |= dict(labels or {})
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": node_labels,
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {
                "podCIDR": f"10.244.{n}.0/24",
                "podCIDRs": [f"10.244.{n}.0/24"],
                "taints": [dict(t) for t in taints],
            },
            # a Node create keeps its status; kwok's node-initialize stage keeps these
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [
                    {"type": "InternalIP", "address": f"10.0.0.{n + 1}"},
                    {"type": "Hostname", "address": name},
                ],
            },
        }
        self.kubectl("create", "-f", "-", input=json.dumps(node))
        (self.gpu_nodes if gpus else self.cpu_nodes).append(name)
        if wait:
            self.wait_nodes_ready([name])

    def nodes_ready(self, names: Sequence[str]) -> bool:
        """Ready condition true and no not-ready/unreachable taint left on every node."""
        items = {n["metadata"]["name"]: n for n in self.kubectl_json("get", "nodes")["items"]}
        for name in names:
            node = items.get(name)
            if node is None:
                return False
            conds = node.get("status", {}).get("conditions", [])
            if not any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                return False
            taints = node.get("spec", {}).get("taints", [])
            if any(t["key"].startswith("node.kubernetes.io/") for t in taints):
                return False
        return True

    def wait_nodes_ready(self, names: Sequence[str], timeout_s: float = 90.0) -> None:
        self.wait_until(
            f"nodes {', '.join(names)} Ready",
            lambda: self.nodes_ready(names),
            timeout_s=timeout_s,
            component="kwok",
            interval_s=0.5,
        )


def start_cluster(
    *,
    bin_dir: Path | None = None,
    gpu_nodes: int = 2,
    gpus_per_node: int = 8,
    cpu_nodes: int = 1,
    workdir: Path | None = None,
    timeout_scale: float | None = None,
) -> K8sCluster:
    """Start etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok.

    Creates ``gpu_nodes`` fake GPU nodes (``kwok-gpu-<i>``, alternating zones zone-a and
    zone-b, ``gpus_per_node`` x nvidia.com/gpu) and ``cpu_nodes`` plain ones
    (``kwok-cpu-<i>``), and waits until they are Ready and the ``default`` ServiceAccount
    exists. On failure everything started is stopped and the error carries the log tail;
    the workdir is kept for inspection.
    """
    bin_dir = bin_dir or find_bin_dir()
    scale = timeout_scale or float(os.environ.get("KVPLANE_K8S_TIMEOUT_SCALE", "1"))
    work = workdir or Path(tempfile.mkdtemp(prefix="kvplane-k8s-"))
    pki = work / "pki"
    _make_pki(pki)
    token = secrets.token_hex(24)
    (work / "tokens.csv").write_text(f'{token},kvplane-admin,kvplane-admin,"system:masters"\n')
    api_port, *ports = free_ports(6)
    server = f"https://127.0.0.1:{api_port}"
    kubeconfig = work / "admin.kubeconfig"
    kubeconfig.write_text(
        _kubeconfig(server, (pki / "ca.crt").read_bytes(), token, "kvplane-admin", "default")
    )
    kubeconfig.chmod(0o600)
    version = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        version = subprocess.run(
            [str(bin_dir / "kube-apiserver"), "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.split()[-1]
    cluster = K8sCluster(
        bin_dir=bin_dir,
        workdir=work,
        server=server,
        kubeconfig=kubeconfig,
        ca_file=pki / "ca.crt",
        admin_token=token,
        version=version,
    )
    try:
        _launch(cluster, api_port=api_port, ports=ports, scale=scale)
        for i in range(gpu_nodes):
            zone = "zone-a" if i % 2 == 0 else "zone-b"
            cluster.add_node(f"kwok-gpu-{i}", gpus=gpus_per_node, zone=zone, wait=False)
        for i in range(cpu_nodes):
            cluster.add_node(f"kwok-cpu-{i}", zone="zone-a", wait=False)
        cluster.wait_nodes_ready(cluster.gpu_nodes + cluster.cpu_nodes, timeout_s=90 * scale)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _launch(cluster: K8sCluster, *, api_port: int, ports: list[int], scale: float) -> None:
    work, pki = cluster.workdir, cluster.workdir / "pki"
    kubeconfig = str(cluster.kubeconfig)

    etcd_port, peer_port, kcm_port, sched_port, kwok_port = ports
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    cluster.start_component(
        "etcd",
        [
            "etcd",
            "--name=kvplane",
            f"--data-dir={work / 'etcd'}",
            "--log-level=warn",
            "--unsafe-no-fsync",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=kvplane={peer_url}",
        ],
    )
    cluster.wait_until(
        "etcd /health",
        lambda: _http_ok(f"{etcd_url}/health"),
        timeout_s=30 * scale,
        component="etcd",
    )

    (work / "audit-policy.yaml").write_text(AUDIT_POLICY)
    cluster.start_component(
        "kube-apiserver",
        [
            "kube-apiserver",
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--advertise-address={ADVERTISE_ADDRESS}",
            f"--cert-dir={work / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={work / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            f"--audit-policy-file={work / 'audit-policy.yaml'}",
            f"--audit-log-path={cluster.audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=200",
            "--audit-log-maxbackup=1",
            "--v=1",
        ],
    )
    ca_ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    cluster.wait_until(
        "kube-apiserver /readyz",
        lambda: _http_ok(f"{cluster.server}/readyz", ctx=ca_ctx, token=cluster.admin_token),
        timeout_s=120 * scale,
        component="kube-apiserver",
        interval_s=0.5,
    )

    delegated = [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
    ]
    cluster.start_component(
        "kube-controller-manager",
        [
            "kube-controller-manager",
            *delegated,
            f"--secure-port={kcm_port}",
            f"--cert-dir={work / 'kcm-certs'}",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--profiling=false",
            "--v=1",
        ],
    )
    sched_cfg = work / "scheduler.yaml"
    sched_cfg.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": kubeconfig},
                "leaderElection": {"leaderElect": False},
            }
        )
    )
    cluster.start_component(
        "kube-scheduler",
        [
            "kube-scheduler",
            f"--config={sched_cfg}",
            *[a for a in delegated if not a.startswith(("--kubeconfig", "--leader-elect"))],
            f"--secure-port={sched_port}",
            f"--cert-dir={work / 'scheduler-certs'}",
            "--v=1",
        ],
    )
    kwok_home = work / "kwok-home"  # kwok reads ~/.kwok/kwok.yaml: keep the user's out
    kwok_home.mkdir()
    cluster.start_component(
        "kwok",
        [
            "kwok",
            f"--kubeconfig={kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            "--cidr=10.0.0.0/24",
            "--node-ip=10.0.0.1",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{kwok_port}",
        ],
        home=kwok_home,
    )
    insecure = _insecure_ctx()
    for name, url, ctx in (
        ("kube-controller-manager", f"https://127.0.0.1:{kcm_port}/healthz", insecure),
        ("kube-scheduler", f"https://127.0.0.1:{sched_port}/healthz", insecure),
        ("kwok", f"http://127.0.0.1:{kwok_port}/healthz", None),
    ):
        cluster.wait_until(
            f"{name} /healthz",
            _probe(url, ctx),
            timeout_s=90 * scale,
            component=name,
        )
    # The ServiceAccount admission plugin rejects pods until the SA controller has made
    # the namespace's "default" ServiceAccount.
    cluster.wait_until(
        "ServiceAccount default/default",
        lambda: (
            cluster.kubectl("get", "sa", "default", "-n", "default", check=False).returncode == 0
        ),
        timeout_s=60 * scale,
        component="kube-controller-manager",
        interval_s=0.5,
    )


@contextlib.contextmanager
def running_cluster(**kwargs: Any) -> Iterator[K8sCluster]:
    """``start_cluster(**kwargs)``; stop it and remove its workdir afterwards
    (``KVPLANE_K8S_KEEP=1`` keeps the workdir with the logs)."""
    cluster = start_cluster(**kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()
        if not os.environ.get("KVPLANE_K8S_KEEP"):
            shutil.rmtree(cluster.workdir, ignore_errors=True)
