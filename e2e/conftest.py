"""Run the operator and CRD suites against any cluster: ``KUBECONFIG=... pytest e2e``.

The tests are the ones in tests/ (test_operator.py, test_crds_apiserver.py); only
the cluster fixture changes: instead of starting a local control plane, it wraps
the cluster of the current KUBECONFIG with the same small API (kubectl,
wait_until, activated). GPU nodes must exist (or be faked with kwok, see README).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))


class ExternalCluster:
    """The subset of support.k8s_cluster.K8sCluster the shared tests use."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        out = subprocess.run(
            ["kubectl", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any] | str, *, namespace: str | None = None) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        self.kubectl("apply", *(["-n", namespace] if namespace else []), "-f", "-", input=text)

    def wait_until(
        self, what: str, check: Callable[[], bool], *, timeout_s: float, **_: Any
    ) -> None:
        deadline = time.monotonic() + timeout_s * float(os.environ.get("E2E_TIMEOUT_SCALE", "3"))
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(1.0)

    @contextlib.contextmanager
    def activated(self, kubeconfig: Path | None = None) -> Iterator[Path]:
        path = kubeconfig or self.kubeconfig
        old = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(path)
        try:
            yield path
        finally:
            if old is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = old


@pytest.fixture(scope="session")
def k8s_cluster() -> ExternalCluster:
    path = os.environ.get("KUBECONFIG")
    if not path:
        pytest.exit("set KUBECONFIG to the cluster to test", returncode=2)
    return ExternalCluster(Path(path))


@pytest.fixture
def k8s_namespace(k8s_cluster: ExternalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{base}-{secrets.token_hex(3)}"
    k8s_cluster.kubectl("create", "namespace", name)
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
