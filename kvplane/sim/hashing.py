"""vLLM v1 prefix-caching block hashes, bit-exact (engine-interfaces.md §2).

``hash(parent, tuple(block tokens), extra_keys)`` (``None``, or a LoRA adapter's)
chained from ``NONE_HASH = hash(seed)``, over full blocks only; the seed is
``PYTHONHASHSEED`` or vLLM's fixed default ``"vllm-none-hash"`` (vLLM uses a random seed
for the xxhash variants when the variable is unset; the simulator keeps the fixed one so
runs are reproducible). Events carry the last 8 bytes of a digest as an unsigned
big-endian int.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Final

import cbor2
import xxhash

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
HASH_ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_PICKLE_PROTOCOL: Final = 5  # pickle.HIGHEST_PROTOCOL on every supported CPython

HashFn = Callable[[Any], bytes]


def _sha256(x: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(x, protocol=_PICKLE_PROTOCOL)).digest()


def _sha256_cbor(x: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def _xxhash(x: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(x, protocol=_PICKLE_PROTOCOL))


def _xxhash_cbor(x: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(x, canonical=True))


_FUNCTIONS: Final[dict[str, HashFn]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


def hash_function(algo: str) -> HashFn:
    """vLLM's ``--prefix-caching-hash-algo`` function by name."""
    try:
        return _FUNCTIONS[algo]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {algo!r}; one of {HASH_ALGOS}") from None


def resolve_seed(seed: str | None) -> str:
    """The NONE_HASH seed vLLM would use: the given one, else the environment's."""
    if seed is not None:
        return seed
    return os.environ.get("PYTHONHASHSEED") or DEFAULT_NONE_HASH_SEED


@functools.lru_cache(maxsize=64)
def _none_hash(algo: str, seed: str) -> bytes:
    return hash_function(algo)(seed)


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The parent of a chain's first block."""
    return _none_hash(algo, resolve_seed(seed))


def chain(
    fn: HashFn,
    parent: bytes,
    token_ids: Sequence[int],
    block_size: int,
    start: int,
    end: int,
    out: list[bytes],
    tokens_out: list[tuple[int, ...]] | None = None,
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """Append the hashes of the full blocks ``start <= i < end`` of ``token_ids`` to
    ``out``, chained from ``parent``; returns the last hash. ``tokens_out`` also gets
    each block's tokens (the tuple that was hashed); ``extra_keys`` go into every
    block's hash (a LoRA adapter's)."""
    for i in range(start, end):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = fn((parent, block, extra_keys))
        out.append(parent)
        if tokens_out is not None:
            tokens_out.append(block)
    return parent


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    seed: str | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block is
    not hashed), starting from ``parent`` or NONE_HASH."""
    out: list[bytes] = []
    chain(
        hash_function(algo),
        parent or none_hash(algo, seed),
        token_ids,
        block_size,
        0,
        len(token_ids) // block_size,
        out,
    )
    return out


def external_hash(h: bytes) -> int:
    """The value KV events carry: the digest's last 8 bytes, unsigned big-endian."""
    return int.from_bytes(h[-8:], "big")
