"""``kvplane bench soak``: the router under steady traffic for a long time, on loopback.

A simulated fleet (``kvplane sim``, small KV caches so that blocks are evicted and the
residency index turns over), the router as ``kvplane router`` would run it, and an
open-loop client at a fixed rate: shared system prompts, growing conversations,
unique prompts (new residency every time), some streamed, some refused (an unknown
model). Every window records the router's RSS and file descriptors, the index's size
(Redis keys and memory), errors and latency percentiles; a leak shows as growth from
the first warm window to the last. Results: ``bench/results/soak-<date>.json`` and a
section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import socket
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from kvplane.bench.pool_limits import client_limits, fd_budget
from kvplane.bench.procs import (
    HOST,
    Proc,
    bench_relative,
    default_tokenizer_dir,
    machine_info,
    results_dir,
    spawn,
    update_markdown,
    venv_bin,
    versions,
    wait_ready,
)
from kvplane.local.ports import free_port
from kvplane.workload.results import percentile

MODEL = "sim"
HEADING = "## Soak (`kvplane bench soak`)"
SYSTEM_PROMPTS = 8
CONVERSATIONS = 16
TURNS = 12  # a conversation starts over after this many turns
# the bench tokenizer (DeepSeek's files) ships no chat template; engines and router share this
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="per index backend")
    p.add_argument("--window-s", type=float, default=60.0, help="one row of figures per window")
    p.add_argument("--warmup-windows", type=int, default=2, help="windows before the baseline")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second (open loop)")
    p.add_argument("--index", default="memory,redis", help="index backends, one run each")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--gpu-blocks", type=int, default=1024, help="KV blocks per simulated engine")
    p.add_argument("--tokenizer-cache-tokens", type=int, default=1_000_000)
    p.add_argument("--tokenizer", type=Path, default=None, help="default: DeepSeek's")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="results folder (default: bench/results)")
    p.add_argument("--no-write", action="store_true", help="print only")


@dataclass
class Window:
    t_s: float
    requests: int
    errors: int  # 5xx, transport errors, broken streams
    refused: int  # the deliberate 4xx
    p50_ms: float | None
    p99_ms: float | None
    rss_mb: float
    fds: int
    index_keys: int | None
    index_mb: float | None


@dataclass
class SoakRun:
    index: str
    windows: list[Window] = field(default_factory=list)
    router_log_lines: int = 0

    def summary(self, warmup: int) -> dict[str, Any]:
        warm = self.windows[min(warmup, len(self.windows) - 1)] if self.windows else None
        last = self.windows[-1] if self.windows else None
        out: dict[str, Any] = {
            "requests": sum(w.requests for w in self.windows),
            "errors": sum(w.errors for w in self.windows),
            "refused": sum(w.refused for w in self.windows),
            "router_log_lines": self.router_log_lines,
        }
        if warm is not None and last is not None:
            out["rss_mb"] = [warm.rss_mb, last.rss_mb]
            out["fds"] = [warm.fds, last.fds]
            out["index_keys"] = [warm.index_keys, last.index_keys]
            out["index_mb"] = [warm.index_mb, last.index_mb]
            out["p99_ms"] = [warm.p99_ms, last.p99_ms]
        return out


# -- the traffic ---------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(n)
    )


class Traffic:
    """The next request body: a mix that both reuses prefixes and keeps adding new ones."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.systems = [_words(self.rng, 300) for _ in range(SYSTEM_PROMPTS)]
        self.chats: list[list[dict[str, str]]] = [[] for _ in range(CONVERSATIONS)]

    def next(self) -> tuple[str, dict[str, Any], bool]:
        """(path, body, whether a 4xx is expected)."""
        r = self.rng.random()
        stream = self.rng.random() < 0.25
        common = {"model": MODEL, "max_tokens": 8, "stream": stream}
        if r < 0.02:
            return "/v1/completions", {**common, "model": "no-such-model", "prompt": "x"}, True
        if r < 0.45:
            prompt = self.rng.choice(self.systems) + "\n" + _words(self.rng, 20)
            return "/v1/completions", {**common, "prompt": prompt}, False
        if r < 0.75:
            chat = self.rng.choice(self.chats)
            if len(chat) >= 2 * TURNS:
                chat.clear()
            chat.append({"role": "user", "content": _words(self.rng, 40)})
            body = {**common, "messages": list(chat)}
            chat.append({"role": "assistant", "content": _words(self.rng, 10)})
            return "/v1/chat/completions", body, False
        return "/v1/completions", {**common, "prompt": _words(self.rng, 400)}, False


@dataclass
class _Tally:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    refused: int = 0
    requests: int = 0


async def _one(
    client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], expect_4xx: bool
) -> tuple[float, str]:
    """(latency ms, outcome: ok | refused | error)."""
    start = time.perf_counter()
    try:
        if body.get("stream"):
            async with client.stream("POST", url + path, json=body) as resp:
                data = b"".join([c async for c in resp.aiter_raw()])
                ok = resp.status_code == 200 and data.rstrip().endswith(b"[DONE]")
                ok = ok and b'"error"' not in data
                status = resp.status_code
        else:
            resp = await client.post(url + path, json=body)
            status, ok = resp.status_code, resp.status_code == 200
    except httpx.HTTPError:
        return (time.perf_counter() - start) * 1e3, "error"
    ms = (time.perf_counter() - start) * 1e3
    if 400 <= status < 500 and expect_4xx:
        return ms, "refused"
    return ms, "ok" if ok and not expect_4xx else "error"


async def drive(
    url: str,
    rate: float,
    duration_s: float,
    window_s: float,
    sample: Callable[[], dict[str, Any]],
    seed: int,
    on_window: Callable[[Window], None] = lambda w: None,
) -> list[Window]:
    """Open-loop traffic at ``rate`` for ``duration_s``; a ``Window`` every ``window_s``."""
    traffic, rng = Traffic(seed), random.Random(seed + 1)
    loop = asyncio.get_running_loop()
    windows: list[Window] = []
    tally = _Tally()
    inflight: set[asyncio.Task[None]] = set()
    limits = client_limits(256, fd_budget())  # pool_limits.client_limits says why

    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:

        async def request() -> None:
            path, body, expect_4xx = traffic.next()
            ms, outcome = await _one(client, url, path, body, expect_4xx)
            tally.requests += 1
            if outcome == "ok":
                tally.latencies_ms.append(ms)
            elif outcome == "refused":
                tally.refused += 1
            else:
                tally.errors += 1

        start = loop.time()
        next_window = start + window_s
        next_send = start

        async def close_window() -> None:
            nonlocal tally
            stats = await asyncio.to_thread(sample)
            lat = tally.latencies_ms
            window = Window(
                round(loop.time() - start, 1),
                tally.requests,
                tally.errors,
                tally.refused,
                percentile(lat, 50) if lat else None,
                percentile(lat, 99) if lat else None,
                **stats,
            )
            windows.append(window)
            on_window(window)
            tally = _Tally()

        while (now := loop.time()) < start + duration_s:
            if now >= next_window:
                await close_window()
                next_window += window_s
            if len(inflight) < 512:  # bounded: a stuck router cannot pile up tasks
                task = asyncio.create_task(request())
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            next_send += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_send - loop.time()))
        if inflight:
            await asyncio.wait(inflight, timeout=60)
        if tally.requests:  # the last window, cut by the end of the run
            await close_window()
    return windows


# -- the processes ---------------------------------------------------------------------


def _start_redis(rundir: Path) -> tuple[Proc, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("bench soak: the Redis index needs redis-server (apt install)")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
    proc = spawn("redis", [*argv, "--dir", str(rundir)], rundir)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.alive():
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return proc, f"redis://{HOST}:{port}/0"
        time.sleep(0.05)
    raise SystemExit(f"bench soak: redis-server did not start:\n{proc.tail()}")


@contextlib.contextmanager
def fleet(args: argparse.Namespace, rundir: Path, index: str) -> Iterator[tuple[str, Proc, str]]:
    """Sim engines, Redis (for the Redis index), the indexer and the router:
    (router URL, router process, Redis URL or "")."""
    procs: list[Proc] = []
    tokenizer = args.tokenizer or default_tokenizer_dir()
    cfg_file = rundir / f"sim-{index}.yaml"
    template = rundir / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    try:
        argv = [venv_bin("kvplane"), "--log-level", "warning", "sim", "--model", MODEL]
        argv += ["--tokenizer", str(tokenizer), "--engines", str(args.engines)]
        argv += ["--num-gpu-blocks", str(args.gpu_blocks), "--host", HOST]
        argv += ["--router-config", str(cfg_file), "--chat-template", str(template)]
        sim = spawn(f"sim-{index}", argv, rundir)
        procs.append(sim)
        deadline = time.monotonic() + 120
        while not cfg_file.exists() or not cfg_file.read_text():
            if not sim.alive() or time.monotonic() > deadline:
                raise SystemExit(f"bench soak: the simulated fleet did not start:\n{sim.tail()}")
            time.sleep(0.2)
        config = yaml.safe_load(cfg_file.read_text())
        config["model"]["tokenizer_cache_tokens"] = args.tokenizer_cache_tokens
        redis_url = ""
        if index == "redis":
            redis, redis_url = _start_redis(rundir)
            procs.append(redis)
            config["index"] = {"backend": "redis", "url": redis_url}
        router_cfg = rundir / f"router-{index}.yaml"
        router_cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        if index == "redis":
            ingest = [venv_bin("kvplane"), "indexer", "--config", str(router_cfg)]
            procs.append(spawn(f"indexer-{index}", [*ingest, "--metrics-port", "0"], rundir))
        port = free_port()
        argv = [venv_bin("kvplane"), "router", "--config", str(router_cfg), "--port", str(port)]
        router = spawn(f"router-{index}", argv, rundir)
        procs.append(router)
        probe = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
        if not wait_ready(router, port, 120, probe):
            raise SystemExit(f"bench soak: the router did not start:\n{router.tail()}")
        yield f"http://{HOST}:{port}", router, redis_url
    finally:
        for proc in reversed(procs):
            proc.stop()


def sampler(router: Proc, redis_url: str) -> Callable[[], dict[str, Any]]:
    """The figures a window records besides traffic: the router process and the index."""
    proc = psutil.Process(router.popen.pid)
    redis_client = None
    if redis_url:
        import redis

        redis_client = redis.Redis.from_url(redis_url)

    def sample() -> dict[str, Any]:
        out: dict[str, Any] = {
            "rss_mb": round(proc.memory_info().rss / 2**20, 1),
            "fds": proc.num_fds(),
            "index_keys": None,
            "index_mb": None,
        }
        if redis_client is not None:
            out["index_keys"] = int(redis_client.dbsize())
            used = redis_client.info("memory")["used_memory"]
            out["index_mb"] = round(int(used) / 2**20, 2)
        return out

    return sample


def soak_one(args: argparse.Namespace, rundir: Path, index: str) -> SoakRun:
    run = SoakRun(index)

    def show(w: Window) -> None:
        if not getattr(args, "quiet", False):
            keys = "" if w.index_keys is None else f" keys {w.index_keys} ({w.index_mb} MB)"
            print(
                f"[{index}] {w.t_s:7.0f}s  req {w.requests:5d}  err {w.errors}  "
                f"p50 {w.p50_ms or 0:7.1f} ms  p99 {w.p99_ms or 0:7.1f} ms  "
                f"rss {w.rss_mb:6.1f} MB  fds {w.fds}{keys}",
                flush=True,
            )

    with fleet(args, rundir, index) as (url, router, redis_url):
        run.windows = asyncio.run(
            drive(
                url,
                args.rate,
                args.minutes * 60,
                args.window_s,
                sampler(router, redis_url),
                args.seed,
                show,
            )
        )
        run.router_log_lines = len(router.log.read_text(errors="replace").splitlines())
    return run


# -- the report --------------------------------------------------------------------------


def _fmt(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def markdown(record: dict[str, Any], json_path: str) -> str:
    load = "/".join(f"{x:.2f}" for x in record["machine"].get("loadavg_start", []))
    lines = [
        HEADING,
        "",
        f"`kvplane bench soak {' '.join(record['argv'])}` ({record['date']}, "
        f"{record['machine'].get('nproc')} cores, {record['machine'].get('cpu_model')}, "
        f"load average {load} at start; figures: `{json_path}`). Loopback, "
        f"{record['engines']} simulated engines of {record['gpu_blocks']} KV blocks, an "
        f"open-loop client at {record['rate']:g} req/s (shared system prompts, growing "
        "conversations, unique prompts, a quarter streamed, 2% refused by design). "
        f"Baseline: window {record['warmup_windows'] + 1}. p50/p99: end-to-end latency of "
        "the requests that succeeded; index keys and MB: Redis `DBSIZE` and `used_memory`.",
        "",
    ]
    for run in record["runs"]:
        s = run["summary"]
        lines += [
            f"**{run['index']} index**: {s['requests']:,} requests, {s['errors']} errors, "
            f"{s['refused']} refused by design; router log {s['router_log_lines']} lines.",
            "",
            "| window end (s) | requests | errors | p50 ms | p99 ms | router RSS MB | FDs "
            "| index keys | index MB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for w in run["windows"]:
            lines.append(
                "| "
                + " | ".join(
                    _fmt(w[k])
                    for k in (
                        "t_s",
                        "requests",
                        "errors",
                        "p50_ms",
                        "p99_ms",
                        "rss_mb",
                        "fds",
                        "index_keys",
                        "index_mb",
                    )
                )
                + " |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    folder, md = results_dir(args.out)
    stamp = datetime.now(UTC)
    rundir = folder / f"soak-run-{stamp:%Y%m%d-%H%M%S}"
    rundir.mkdir(parents=True, exist_ok=True)
    runs = []
    for index in [i.strip() for i in args.index.split(",") if i.strip()]:
        result = soak_one(args, rundir, index)
        runs.append(
            {
                "index": index,
                "windows": [asdict(w) for w in result.windows],
                "summary": result.summary(args.warmup_windows),
            }
        )
    record = {
        "date": f"{stamp:%Y-%m-%d}",
        "argv": list(getattr(args, "argv_echo", [])),
        "machine": machine_info(),
        "versions": versions(),
        "engines": args.engines,
        "gpu_blocks": args.gpu_blocks,
        "rate": args.rate,
        "warmup_windows": args.warmup_windows,
        "runs": runs,
    }
    if not args.no_write:
        path = folder / f"soak-{stamp:%Y-%m-%d}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        update_markdown(md, markdown(record, bench_relative(path)), HEADING)
        print(f"bench soak: {path} and {md}")
    shutil.rmtree(rundir, ignore_errors=True)
    return record
