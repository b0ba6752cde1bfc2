"""Token ids -> chained block keys.

A key is xxh3_64 over one full block of token ids (uint32 little-endian),
seeded with the previous block's key; the first block is seeded with the
generation's root. Equal prefixes give equal keys on every replica, and two
generations never share a key because their roots differ.

A LoRA adapter's blocks chain from the adapter's own root (``adapter_root``), as
vLLM folds ``("lora", name, path)`` into every block hash of an adapter request
(``vllm/v1/core/kv_cache_utils.py``): a base-model block and an adapter block of the
same tokens never share a key, nor do two adapters'. The name alone picks the root,
because the engine's KV events carry the adapter's name (``lora_name``), not its path.
"""

from array import array
from collections.abc import Sequence

import xxhash


def generation_root(generation: str) -> int:
    """The seed of a chain: a pure function of the pool's generation tag."""
    return xxhash.xxh3_64_intdigest(generation.encode())


def adapter_root(root: int, adapter: str | None) -> int:
    """The chain root of ``adapter``'s blocks (``root`` itself for the base model)."""
    if adapter is None:
        return root
    return xxhash.xxh3_64_intdigest(b"lora\x00" + adapter.encode(), root)


def chain_keys(
    tokens: Sequence[int], block_size: int, parent: int, start_block: int = 0
) -> list[int]:
    """Keys of every full block of ``tokens``, chained from ``parent``.

    ``start_block`` skips blocks whose keys the caller already has (``parent``
    is then the key of the block before it).
    """
    n_full = len(tokens) // block_size
    if n_full <= start_block:
        return []
    raw = array("I", tokens[start_block * block_size : n_full * block_size]).tobytes()
    step = 4 * block_size
    keys: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    for off in range(0, len(raw), step):
        parent = digest(raw[off : off + step], parent)
        keys.append(parent)
    return keys


def block_keys(tokens: Sequence[int], block_size: int, root: int) -> list[int]:
    """Keys of a whole prompt from the generation root."""
    return chain_keys(tokens, block_size, root)
