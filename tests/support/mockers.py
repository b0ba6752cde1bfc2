"""Dynamo's mockers for the tests: two of them behind one direct-mode frontend."""

from __future__ import annotations

from pathlib import Path

from kvplane.bench.peers import dynamo_mocker
from kvplane.bench.peers.dynamo import ensure_dynamo


def direct_fleet(
    model: str, tokenizer: Path, rundir: Path, kv_blocks: int = 2048, host_blocks: int = 0
) -> dynamo_mocker.MockerFleet:
    """Two real mockers (Dynamo from PyPI, scripts/setup-dynamo.sh) of ``model`` with
    ``tokenizer``, ``kv_blocks`` blocks of 64 tokens of HBM each and a host tier of
    ``host_blocks`` (none: 0), behind one real ``dynamo.frontend --router-mode direct``;
    the caller stops the fleet."""
    ensure_dynamo()
    spec = dynamo_mocker.MockerSpec(
        model=model,
        tokenizer=tokenizer,
        block_size=64,
        kv_blocks=kv_blocks,
        max_num_batched_tokens=8192,
        max_model_len=32768,
        kv_bytes_per_token=131072,
        time_scale=1.0,
        host_blocks=host_blocks,
    )
    return dynamo_mocker.start_fleet(spec, 2, rundir, direct=True)
