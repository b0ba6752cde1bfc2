"""The generation tag: which pool and model identity a block key belongs to.

Residency is only reusable between pods that would compute the same KV for the
same tokens, so the tag covers everything that changes the KV bytes or the
token ids: model name, revision, tokenizer and block size. It also names the pool
(for the operator, its namespace and name), so that two pools serving the same
model through one Redis keep apart: every index key carries the tag, and
deleting one pool's keys (``kvp:{tag}:*``) never touches another's.
"""

import hashlib
import json


def generation_tag(
    model: str, revision: str, tokenizer: str, block_size: int, pool: str = ""
) -> str:
    body = json.dumps(
        {
            "model": model,
            "revision": revision,
            "tokenizer": tokenizer,
            "block_size": block_size,
            "pool": pool,
        },
        sort_keys=True,
    )
    return hashlib.sha256(body.encode()).hexdigest()[:12]
