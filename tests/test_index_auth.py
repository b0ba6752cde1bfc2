"""The index behind a password and over TLS, with real redis-servers.

The managed Redis is started exactly as the operator renders it (its container's
arguments, its password Secret's config file), and refuses anyone without the
password, while the router's index, given it as the operator does, works. An
external index over TLS (``rediss://``, a CA of the test's own) serves the router's
index as configured in a router config.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kvplane.operator.api import InferencePoolSpec
from kvplane.operator.render import stores
from kvplane.router.app import make_index
from kvplane.router.config import RouterConfig
from kvplane.router.index.base import Blocks
from kvplane.router.index.redis import RedisIndex
from kvplane.router.tiers import Tier

from kvplane.local.ports import free_port

SPEC = {
    "model": {
        "servedName": "m",
        "source": "org/m",
        "shape": {"layers": 2, "kvHeads": 2, "headDim": 64},
    }
}
PASSWORD = "a-password-for-the-test"
KEYS = [11, 12, 13]


def _wait(port: int, **kw: object) -> None:
    client = redis.Redis(host="127.0.0.1", port=port, **kw)  # type: ignore[arg-type]
    for _ in range(200):
        try:
            client.ping()
            return
        except redis.AuthenticationError:
            return  # up, and refusing us
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis on {port} never came up")


def redis_container() -> dict[str, Any]:
    """The managed Redis' container as the operator renders it."""
    spec = InferencePoolSpec.model_validate(SPEC)
    deployment = next(o for o in stores.redis_objects("p", "ns", spec) if o["kind"] == "Deployment")
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.fixture
def managed(tmp_path: Path) -> Iterator[int]:
    """redis-server with the rendered container's arguments and Secret."""
    container = redis_container()
    secret = stores.index_secret("p", "ns", PASSWORD)
    conf = tmp_path / stores.INDEX_CONF_KEY
    conf.write_bytes(base64.b64decode(secret["data"][stores.INDEX_CONF_KEY]))
    port = free_port()
    args = [str(conf) if a.startswith(stores.REDIS_CONF_DIR) else a for a in container["args"][1:]]
    args[args.index("--port") + 1] = str(port)
    exe = shutil.which("redis-server")
    assert exe is not None
    proc = subprocess.Popen(
        [exe, *args, "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(port)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_managed_redis_refuses_anyone_without_its_password(managed: int) -> None:
    assert "--protected-mode" not in redis_container()["args"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=managed).ping()
    # the probes' redis-cli reads the password from REDISCLI_AUTH, as rendered
    env = redis_container()["env"]
    assert env[0]["name"] == "REDISCLI_AUTH"
    probe = subprocess.run(
        ["redis-cli", "-p", str(managed), "ping"],
        env={**os.environ, "REDISCLI_AUTH": PASSWORD},
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "PONG"


async def test_the_index_uses_the_managed_redis_password(managed: int) -> None:
    url = f"redis://127.0.0.1:{managed}/0"
    outsider = RedisIndex(url, "auth")
    with pytest.raises(redis.AuthenticationError):
        await outsider.ping()
    await outsider.close()
    index = RedisIndex(url, "auth", password=PASSWORD)
    try:
        await index.begin_incarnation("a", "1")
        await index.store("a", "1", Blocks.of_prompt(KEYS), Tier.HBM)
        assert (await index.lookup(KEYS, ["a"]))["a"][Tier.HBM] == 3
    finally:
        await index.close()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """redis-server on TLS only, its certificate signed by a CA of this test's own."""
    ca_key, ca, key, csr, cert = (
        tmp_path / n for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem")
    )
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=kvplane-test-ca",
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=127.0.0.1",
    )
    ext = tmp_path / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    port = free_port()
    exe = shutil.which("redis-server")
    assert exe is not None
    argv = [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
    argv += [
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(ca),
    ]
    argv += ["--tls-auth-clients", "no", "--requirepass", PASSWORD]
    argv += ["--save", "", "--dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(port, ssl=True, ssl_ca_certs=str(ca), password=PASSWORD)
        yield port, ca
    finally:
        proc.terminate()
        proc.wait(10)


async def test_an_external_index_over_tls(
    tls_redis: tuple[int, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    port, ca = tls_redis
    config = RouterConfig.model_validate(
        {
            "model": {"name": "m", "tokenizer": str(tmp_path), "generation": "tls"},
            "index": {
                "backend": "redis",
                "url": f"rediss://127.0.0.1:{port}/0",
                "tls_ca_file": str(ca),
            },
        }
    )
    monkeypatch.setenv("KVPLANE_INDEX_PASSWORD", PASSWORD)  # as the operator sets it
    index = make_index(config, "tls")
    try:
        await index.begin_incarnation("a", "1")
        await index.store("a", "1", Blocks.of_prompt(KEYS), Tier.HBM)
        await index.mark_tentative("b", Blocks.of_prompt(KEYS), 5.0)
        got = await index.lookup(KEYS, ["a", "b"])
        assert got["a"][Tier.HBM] == 3 and got["b"][Tier.HBM] == 3
    finally:
        await index.close()
    # not without the CA: the certificate is the test's own
    stranger = RedisIndex(f"rediss://127.0.0.1:{port}/0", "tls", password=PASSWORD)
    with pytest.raises(redis.ConnectionError):
        await stranger.ping()
    await stranger.close()
