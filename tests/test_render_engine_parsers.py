"""What the operator renders for SGLang and LMCache, read by their own parsers.

The vLLM command lines have their own test (``test_render_vllm_args``). Here every SGLang
engine Deployment of every scenario in ``test_render.SCENARIOS`` is parsed, exactly as
rendered, by SGLang's ``ServerArgs`` (its CLI parser, then ``ServerArgs.from_cli_args``,
whose ``__post_init__`` checks the combination), and its ``--kv-events-config`` by SGLang's
``KVEventsConfig.from_cli``; every rendered ``lmcache.yaml`` is loaded by LMCache's
``LMCacheEngineConfig.from_file`` (which warns on keys it does not know), and an S3
remote's config is handed to LMCache's own S3 connector adapter, which asserts the region.
All of it runs in one subprocess of the engine-parsers virtualenv
(``scripts/setup-engine-parsers.sh``: SGLang 0.5.23 and LMCache 0.5.6, over the vLLM
venv's torch), from a temporary directory with ``python -P`` so that neither this
checkout nor kvplane is importable there.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvplane.operator.render.lmcache import LMCACHE_CONFIG_KEY, lmcache_config
from test_render import SCENARIOS, _tier

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parent.parent

PARSE = r"""
import argparse, asyncio, contextlib, io, json, logging, os, sys

from sglang.srt.server_args import ServerArgs
from sglang.srt.disaggregation.kv_events import KVEventsConfig
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend.connector import ConnectorContext
from lmcache.v1.storage_backend.connector.s3_adapter import S3ConnectorAdapter
from lmcache.v1.storage_backend.cache_policy import get_cache_policy

cases = json.load(sys.stdin)
results = {"sglang": {}, "lmcache": {}}
for name, argv in cases["sglang"].items():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        results["sglang"][name] = {"ok": False, "error": err.getvalue().strip().splitlines()[-1:]}
        continue
    result = {"ok": True}
    try:
        args = ServerArgs.from_cli_args(ns)
    except Exception as exc:  # the combination is refused
        results["sglang"][name] = {"ok": False, "error": [f"{type(exc).__name__}: {exc}"]}
        continue
    events = KVEventsConfig.from_cli(args.kv_events_config) if args.kv_events_config else None
    result["events"] = events.model_dump() if events is not None else None
    for key in ("page_size", "tp_size", "served_model_name", "revision", "enable_metrics",
                "enable_cache_report", "enable_hierarchical_cache", "hicache_storage_backend",
                "hicache_storage_backend_extra_config", "disaggregation_mode",
                "disaggregation_transfer_backend", "port", "enable_lora", "lora_paths",
                "max_loras_per_batch"):
        result[key] = getattr(args, key)
    results["sglang"][name] = result


class Unknown(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        if "Unknown configuration key" in record.getMessage():
            self.messages.append(record.getMessage())


for name, path in cases["lmcache"].items():
    unknown = Unknown()
    loggers = [logging.getLogger("lmcache")] + [
        lg for lg in logging.Logger.manager.loggerDict.values()
        if isinstance(lg, logging.Logger) and lg.name.startswith("lmcache.")
    ]
    for lg in loggers:
        lg.addHandler(unknown)
    try:
        config = LMCacheEngineConfig.from_file(path)
    finally:
        for lg in loggers:
            lg.removeHandler(unknown)
    result = {"unknown": unknown.messages, "remote_url": config.remote_url,
              "extra_config": config.extra_config,
              "cache_policy": type(get_cache_policy(config.cache_policy)).__name__}
    if (config.remote_url or "").startswith("s3://"):
        loop = asyncio.new_event_loop()
        try:
            S3ConnectorAdapter().create_connector(
                ConnectorContext(config.remote_url, loop, None, config, None)
            )
        except AssertionError as exc:  # LMCache's own refusal of the config
            result["s3"] = f"refused: {exc}"
        except ValueError as exc:  # past the config checks: it wants the engine's metadata
            result["s3"] = f"accepted ({exc})"
        finally:
            loop.close()
    results["lmcache"][name] = result
json.dump(results, sys.stdout, default=str)
"""


def _engine_containers(kind: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for scenario in SCENARIOS:
        if scenario.spec().engine.kind.value != kind:
            continue
        for obj in scenario.render():
            if obj["kind"] != "Deployment":
                continue
            container = obj["spec"]["template"]["spec"]["containers"][0]
            if container["name"] == "engine":
                out[f"{scenario.name}/{obj['metadata']['name']}"] = container
    return out


def _lmcache_files(tmp: Path) -> dict[str, str]:
    """Every rendered lmcache.yaml, plus S3 remotes with and without a region."""
    files: dict[str, str] = {}
    for scenario in SCENARIOS:
        for obj in scenario.render():
            if obj["kind"] == "ConfigMap" and LMCACHE_CONFIG_KEY in obj.get("data", {}):
                name = f"{scenario.name}/{obj['metadata']['name']}"
                files[name] = obj["data"][LMCACHE_CONFIG_KEY]
    s3 = _tier(tier="remote", backend="s3", url="s3://bucket/kv", region="eu-west-1")
    files["s3/with-region"] = lmcache_config([_tier(tier="dram", capacityPerPod="8Gi"), s3])
    no_region = yaml.safe_load(files["s3/with-region"])
    del no_region["extra_config"]
    files["control/s3-without-region"] = yaml.safe_dump(no_region)
    lfu = [
        _tier(tier="dram", backend="lmcache", capacityPerPod="8Gi", evictionPolicy="lfu"),
        _tier(tier="nvme", backend="lmcache", capacityPerPod="100Gi", evictionPolicy="lfu"),
    ]
    files["lfu/dram-nvme"] = lmcache_config(lfu)
    paths: dict[str, str] = {}
    for i, (name, text) in enumerate(sorted(files.items())):
        path = tmp / f"lmcache-{i}.yaml"
        path.write_text(text)
        paths[name] = str(path)
    with_unknown = tmp / "unknown.yaml"
    with_unknown.write_text(files["s3/with-region"] + "no_such_key: 1\n")
    paths["control/unknown-key"] = str(with_unknown)
    return paths


@pytest.fixture(scope="module")
def engine_parsers_python() -> Path:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup-engine-parsers.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parsed(engine_parsers_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("engine-parsers")
    sglang = {n: c["args"] for n, c in _engine_containers("sglang").items()}
    first = next(iter(sglang.values()))
    sglang["control/unknown-flag"] = [*first, "--no-such-flag"]
    cases = {"sglang": sglang, "lmcache": _lmcache_files(tmp)}
    proc = subprocess.run(
        [str(engine_parsers_python), "-P", "-c", PARSE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=tmp,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_sglang_parses_every_rendered_command_line(parsed: Any) -> None:
    results = parsed["sglang"]
    assert results["control/unknown-flag"]["ok"] is False  # a pass below means accepted
    containers = _engine_containers("sglang")
    assert len(containers) >= 3
    assert all(
        c["command"] == ["python3", "-m", "sglang.launch_server"] for c in containers.values()
    )
    failed = {n: results[n]["error"] for n in containers if not results[n]["ok"]}
    assert not failed, f"SGLang rejected: {failed}"
    for name in containers:
        r = results[name]
        assert r["events"]["publisher"] == "zmq", name
        assert r["events"]["endpoint"] == "tcp://*:5557", name
        assert r["events"]["replay_endpoint"] == "tcp://*:5558", name
        assert r["events"]["topic"] == "kv@$(POD_NAME)@llama-3.1-8b", name
        assert r["page_size"] == 64 and r["served_model_name"] == "llama-3.1-8b", name
        assert r["enable_metrics"] is True and r["enable_cache_report"] is True, name
        assert r["port"] == 8000, name


def test_sglang_hicache_mooncake_and_pd_flags(parsed: Any) -> None:
    results = parsed["sglang"]
    prefill = results["sglang-pd-hicache-mooncake/llama-prefill"]
    decode = results["sglang-pd-hicache-mooncake/llama-decode-main"]
    assert (prefill["disaggregation_mode"], decode["disaggregation_mode"]) == ("prefill", "decode")
    for r in (prefill, decode):
        assert r["disaggregation_transfer_backend"] == "mooncake"
        assert r["enable_hierarchical_cache"] is True
        assert r["hicache_storage_backend"] == "mooncake"
        extra = json.loads(r["hicache_storage_backend_extra_config"])
        assert extra["local_hostname"] == "$(POD_IP)"  # not SGLang's default, localhost
        assert extra["master_server_address"].endswith(":50051")
    assert results["sglang-aggregated/llama-decode-main"]["disaggregation_mode"] == "null"


def test_lmcache_loads_every_rendered_config_without_unknown_keys(parsed: Any) -> None:
    results = parsed["lmcache"]
    assert results["control/unknown-key"]["unknown"]  # the loader does report them
    rendered = [n for n in results if not n.startswith("control/")]
    assert len(rendered) >= 3
    for name in rendered:
        assert results[name]["unknown"] == [], name
    store = results["vllm-pd-lmcache-mooncake-store/llama-lmcache"]
    assert store["remote_url"].startswith("mooncakestore://")


def test_lmcache_s3_connector_accepts_the_rendered_region(parsed: Any) -> None:
    results = parsed["lmcache"]
    assert results["s3/with-region"]["extra_config"] == {"s3_region": "eu-west-1"}
    assert results["s3/with-region"]["s3"].startswith("accepted")
    assert results["control/s3-without-region"]["s3"] == "refused: s3_region is required"


def test_lmcache_takes_lfu_as_its_cache_policy(parsed: Any) -> None:
    """evictionPolicy lfu on LMCache's local tiers is LMCache's own LFUCachePolicy."""
    results = parsed["lmcache"]
    assert results["lfu/dram-nvme"]["cache_policy"] == "LFUCachePolicy"
    assert results["vllm-lmcache-dram-nvme/llama-lmcache"]["cache_policy"] == "LRUCachePolicy"


def test_sglang_lora_adapters_are_its_lora_paths(parsed: Any) -> None:
    """The CRD's adapters come out as SGLang's lora_paths (name and path), LoRA enabled,
    with the pool's maxLoras as max_loras_per_batch; without adapters LoRA stays off."""
    lora = parsed["sglang"]["sglang-lora/llama-decode-main"]
    assert lora["enable_lora"] is True and lora["max_loras_per_batch"] == 2
    # kept as given; SGLang's LoRA hook splits each at its first "=" into name and path
    assert lora["lora_paths"] == ["sql-lora=/adapters/sql", "chat-lora=org/chat-lora"]
    plain = parsed["sglang"]["sglang-aggregated/llama-decode-main"]
    assert not plain["enable_lora"] and not plain["lora_paths"]
