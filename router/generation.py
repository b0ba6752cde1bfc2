"""The generation tag: which model identity a block key belongs to.

Residency is only reusable between pods that would compute the same KV for the
same tokens, so the tag covers everything that changes the KV bytes or the
token ids: model name, revision, tokenizer and block size.
"""

import hashlib
import json


def generation_tag(model: str, revision: str, tokenizer: str, block_size: int) -> str:
    body = json.dumps(
        {"model": model, "revision": revision, "tokenizer": tokenizer, "block_size": block_size},
        sort_keys=True,
    )
    return hashlib.sha256(body.encode()).hexdigest()[:12]
