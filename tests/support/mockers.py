"""Dynamo's mockers for the tests: two of them behind one direct-mode frontend."""

from __future__ import annotations

from pathlib import Path

from kvplane.bench.peers import dynamo_mocker
from kvplane.bench.peers.dynamo import ensure_dynamo


def direct_fleet(model: str, tokenizer: Path, rundir: Path) -> dynamo_mocker.MockerFleet:
    """Two real mockers (Dynamo from PyPI, scripts/setup-dynamo.sh) of ``model`` with
    ``tokenizer``, behind one real ``dynamo.frontend --router-mode direct``; the caller
    stops the fleet."""
    ensure_dynamo()
    spec = dynamo_mocker.MockerSpec(
        model=model,
        tokenizer=tokenizer,
        block_size=64,
        kv_blocks=2048,
        max_num_batched_tokens=8192,
        max_model_len=32768,
        kv_bytes_per_token=131072,
        time_scale=1.0,
    )
    return dynamo_mocker.start_fleet(spec, 2, rundir, direct=True)
