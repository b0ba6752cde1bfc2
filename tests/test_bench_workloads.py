"""Benchmark workloads and metrics: exact prompts with the real DeepSeek tokenizer, the
Mooncake trace, the synthetic shapes and the oracle hit ratio."""

from __future__ import annotations

import itertools
import json
import lzma
import math
from pathlib import Path
from typing import Any

import pytest
from support.router_server import deepseek_tokenizer_dir

from kvplane.workload import results as metrics
from kvplane.workload import traces as workloads
from kvplane.workload.results import RequestResult, RunRecord, oracle_hit_ratio, percentile
from kvplane.workload.traces import PromptBuilder, SegmentTokens, TraceRequest, Workload


def test_the_trace_ships_with_the_package() -> None:
    """The Mooncake trace is package data: a fresh install reads it with nothing beside it."""
    path = workloads.default_mooncake_path()
    assert path.is_file() and path.suffix == ".xz"
    assert path.with_name("NOTICE.md").is_file()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def builder(tokenizer_dir: Path) -> PromptBuilder:
    return PromptBuilder(tokenizer_dir, seed=3)


@pytest.fixture(scope="module")
def engine_tokenizer(tokenizer_dir: Path) -> Any:
    """The tokenizer as an engine loads it, independently of the builder's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- prompts


def test_vocabulary_is_single_token_words(builder: PromptBuilder, engine_tokenizer: Any) -> None:
    assert len(builder.words) >= 2000
    sample = sorted(builder.words)[::97]
    for tid in sample:
        word = builder.words[tid]
        assert word.startswith(" ") and word[1:].isascii() and word[1:].isalpha()
        assert engine_tokenizer.encode(word, add_special_tokens=False) == [tid]


def small_workloads() -> list[Workload]:
    return [
        workloads.generated_shared_prefix(groups=3, per_group=2, system_len=256, question_len=64),
        workloads.multi_round_qa(users=2, rounds=3, system_len=100, history_len=200),
        workloads.long_doc_qa(documents=2, document_len=600, repeat_count=1, question_len=50),
        workloads.no_reuse(n=3, input_len=700),
    ]


def test_text_tokenizes_to_exactly_the_token_ids(
    builder: PromptBuilder, engine_tokenizer: Any
) -> None:
    reqs = [r for wl in small_workloads() for r in wl.requests]
    reqs += workloads.mooncake(limit=4).requests
    for req in reqs:
        ids = builder.token_ids(req)
        assert len(ids) == req.input_length
        assert ids[0] == engine_tokenizer.bos_token_id
        text = builder.text(req)
        assert engine_tokenizer.encode(text, add_special_tokens=True) == ids


def test_segments_are_deterministic_and_order_independent() -> None:
    reqs = [
        TraceRequest(0.0, "a", 1 + 3 * 8, 1, (5, 6, 7), 8),
        TraceRequest(1.0, "b", 1 + 2 * 8, 1, (7, 5), 8),
    ]
    forward = SegmentTokens(range(100, 200), bos=1, seed=9, cache_segments=1)
    backward = SegmentTokens(range(100, 200), bos=1, seed=9)
    a1, b1 = forward.token_ids(reqs[0]), forward.token_ids(reqs[1])
    b2, a2 = backward.token_ids(reqs[1]), backward.token_ids(reqs[0])
    assert (a1, b1) == (a2, b2)
    assert a1[17:25] == b1[1:9]  # segment 7 in both
    assert a1[1:9] != a1[9:17]  # different ids differ
    other_seed = SegmentTokens(range(100, 200), bos=1, seed=10)
    assert other_seed.token_ids(reqs[0]) != a1
    with pytest.raises(ValueError, match="names only"):
        forward.token_ids(TraceRequest(0.0, "c", 100, 1, (1,), 8))


# --------------------------------------------------------------------------- Mooncake


def test_mooncake_parsing(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 513, "output_length": 5, "hash_ids": [0, 3]},
        {"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [0, 4]},
    ]
    path = write_trace(tmp_path / "t.jsonl", rows)
    wl = workloads.mooncake(path)
    assert [r.arrival_s for r in wl.requests] == [0.0, 1.0, 2.0, 3.0]  # batch spread over 3 s
    assert [r.input_length for r in wl.requests] == [1000, 1100, 513, 600]
    assert [r.output_tokens for r in wl.requests] == [10, 1, 5, 7]
    assert wl.requests[1].segments == (0, 1, 2) and wl.segment_tokens == 512
    assert wl.requests[0].session == wl.requests[1].session != wl.requests[2].session

    raw = workloads.mooncake(path, spread_batches=False, rate_scale=2.0)
    assert [r.arrival_s for r in raw.requests] == [0.0, 0.0, 0.0, 1.5]
    part = workloads.mooncake(path, start=1, limit=2, spread_batches=False)
    assert [r.input_length for r in part.requests] == [1100, 513]

    tokens = workloads.synthetic_tokens()
    t0, t1 = (tokens.token_ids(r) for r in wl.requests[:2])
    assert t0[: 1 + 512 + 487] == t1[: 1 + 512 + 487]  # [0, 1] shared, 1 cut short in t0
    assert t1[1 + 1024 :] != []
    bad = write_trace(tmp_path / "bad.jsonl", [{**rows[0], "hash_ids": [0]}])
    with pytest.raises(ValueError, match="hash ids"):
        workloads.mooncake(bad)


def test_mooncake_default_path_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_trace(
        tmp_path / "env.jsonl",
        [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}],
    )
    monkeypatch.setenv(workloads.MOONCAKE_ENV, str(path))
    assert workloads.mooncake().requests[0].input_length == 10
    monkeypatch.setenv(workloads.MOONCAKE_ENV, str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError):
        workloads.mooncake()


def test_shipped_trace_head_blocks_follow_hash_ids() -> None:
    wl = workloads.mooncake(limit=200)
    assert len(wl.requests) == 200
    with lzma.open(workloads.default_mooncake_path(), "rt") as fh:
        lines = [next(fh) for _ in range(200)]
    by_len = sorted(json.loads(x)["input_length"] for x in lines)
    assert sorted(r.input_length for r in wl.requests) == by_len
    tokens = workloads.synthetic_tokens()
    ids = [tokens.token_ids(r) for r in wl.requests[:60]]
    for r, t in zip(wl.requests[:60], ids, strict=True):
        assert len(t) == r.input_length
    checked = 0
    for i in range(60):
        for j in range(i + 1, 60):
            a, b = wl.requests[i], wl.requests[j]
            k = 0
            while k < min(len(a.segments), len(b.segments)) and a.segments[k] == b.segments[k]:
                k += 1
            common = min(1 + k * 512, a.input_length, b.input_length)
            assert ids[i][:common] == ids[j][:common]
            if k < min(len(a.segments), len(b.segments)) and 1 + (k + 1) * 512 <= min(
                a.input_length, b.input_length
            ):
                assert ids[i][common : common + 512] != ids[j][common : common + 512]
                checked += 1
    assert checked > 0


def test_oracle_reproduces_the_published_mooncake_hit_ratio() -> None:
    """With an infinite shared cache of 512-token blocks the trace's hash ids reuse 0.3736
    of its prompt tokens (the figure the Mooncake paper's trace analysis gives for this
    trace). The engine-exact oracle (full blocks, BOS shifts blocks by one token, at
    most n-1 reusable) lands just under it."""
    wl = workloads.mooncake(spread_batches=False)
    assert len(wl.requests) == 12031
    assert metrics.segment_hit_ratio(wl) == pytest.approx(0.3736, abs=5e-5)
    assert oracle_hit_ratio(wl, 512) == pytest.approx(0.3736, abs=5e-4)
    assert oracle_hit_ratio(wl, 64) == pytest.approx(0.3736, abs=5e-4)


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_streamed_oracle_equals_token_oracle(block_size: int, tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 2, "input_length": 1537, "output_length": 1, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 3, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 4, "input_length": 700, "output_length": 1, "hash_ids": [0, 9]},
        {"timestamp": 5, "input_length": 2000, "output_length": 1, "hash_ids": [0, 1, 2, 3]},
    ]
    cases = [workloads.mooncake(write_trace(tmp_path / "t.jsonl", rows)), *small_workloads()]
    cases.append(workloads.mooncake(limit=200))
    for wl in cases:
        tokens = workloads.synthetic_tokens(seed=1)
        by_tokens = oracle_hit_ratio((tokens.token_ids(r) for r in wl.requests), block_size)
        assert oracle_hit_ratio(wl, block_size) == pytest.approx(by_tokens, abs=1e-12)
        assert oracle_hit_ratio(object(), wl, block_size) == oracle_hit_ratio(wl, block_size)


# --------------------------------------------------------------------------- synthetic


def test_generated_shared_prefix_shape() -> None:
    wl = workloads.generated_shared_prefix()
    assert len(wl.requests) == 64 * 16
    assert {r.input_length for r in wl.requests} == {1 + 2048 + 128}
    assert {r.output_tokens for r in wl.requests} == {256}
    groups: dict[str, list[TraceRequest]] = {}
    for r in wl.requests:
        groups.setdefault(r.session, []).append(r)
    assert len(groups) == 64 and {len(v) for v in groups.values()} == {16}
    unit = wl.segment_tokens
    for reqs in groups.values():
        assert len({r.segments[: 2048 // unit] for r in reqs}) == 1
        assert len({r.segments[2048 // unit :] for r in reqs}) == 16
    arrivals = [r.arrival_s for r in wl.requests]
    assert arrivals == sorted(arrivals)
    assert [r.session for r in wl.requests[:16]] != sorted(r.session for r in wl.requests[:16])
    assert workloads.generated_shared_prefix().requests == wl.requests  # deterministic
    assert workloads.generated_shared_prefix(seed=1).requests != wl.requests
    # the first request of a group caches nothing, the other 15 its 2048 system tokens
    expected = 64 * 15 * 2048 / (1024 * 2177)
    assert oracle_hit_ratio(wl, 16) == pytest.approx(expected)


def test_multi_round_qa_grows_each_conversation() -> None:
    wl = workloads.multi_round_qa(users=3, rounds=4, qps=1.5)
    assert len(wl.requests) == 12
    assert [r.arrival_s for r in wl.requests] == [i / 1.5 for i in range(12)]
    for user in ("u0", "u1", "u2"):
        turns = [r for r in wl.requests if r.session == user]
        assert [t.arrival_s - turns[0].arrival_s for t in turns] == [0.0, 2.0, 4.0, 6.0]
        for prev, cur in itertools.pairwise(turns):
            assert cur.segments[: len(prev.segments)] == prev.segments
            assert cur.input_length == prev.input_length + 100 + 20
        assert turns[0].input_length == 1 + 1000 + 2000 + 20
    firsts = [r for r in wl.requests if r.arrival_s < 2.0]
    system = 1000 // wl.segment_tokens
    assert len({r.segments[:system] for r in firsts}) == 1
    assert len({r.segments[system : system + 1] for r in firsts}) == 3


@pytest.mark.parametrize("mode", ["random", "tile", "interleave"])
def test_long_doc_qa_warm_up_then_repeats(mode: str) -> None:
    wl = workloads.long_doc_qa(documents=4, document_len=2000, repeat_count=3, repeat_mode=mode)
    sessions = [r.session for r in wl.requests]
    assert sessions[:4] == ["d0", "d1", "d2", "d3"]
    assert sorted(sessions[4:]) == sorted(["d0", "d1", "d2", "d3"] * 3)
    if mode == "tile":
        assert sessions[4:8] == ["d0", "d1", "d2", "d3"]
    if mode == "interleave":
        assert sessions[4:7] == ["d0"] * 3
    assert len({r.segments for r in wl.requests}) == len(wl.requests)  # unique questions
    assert {r.input_length for r in wl.requests} == {1 + 2000 + 100}


def test_no_reuse_shares_nothing_and_helpers() -> None:
    wl = workloads.no_reuse(n=50, input_len=1000, rate=5.0)
    assert oracle_hit_ratio(wl, 16) == 0.0
    assert {r.input_length for r in wl.requests} == {1000}
    fast = workloads.scale_rate(wl, 2.0)
    assert [r.arrival_s * 2.0 for r in fast.requests] == pytest.approx(
        [r.arrival_s for r in wl.requests]
    )
    assert fast.offered_rps == pytest.approx(2 * wl.offered_rps)
    assert workloads.head(wl, 7).requests == wl.requests[:7]


# --------------------------------------------------------------------------- metrics


def test_percentile_is_nearest_rank() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(xs, q) for q in (0, 20, 21, 50, 90, 100)] == [1, 1, 2, 3, 5, 5]
    with pytest.raises(ValueError):
        percentile([], 50)


def test_imbalance_counts_idle_engines() -> None:
    assert metrics.imbalance({"a": 10, "b": 10}) == 1.0
    assert metrics.imbalance({"a": 30, "b": 0, "c": 0}) == 3.0
    assert metrics.imbalance({"a": 0}) == 1.0


def test_summarize_and_row_keys() -> None:
    results = [
        RequestResult("r", True, 0.1, 0.01, 1.0, 1000, 500, "e0", 0.0),
        RequestResult("r", True, 0.3, 0.02, 2.0, 1000, 0, "e1", 1.0),
        RequestResult("r", True, 0.2, None, 0.2, 2000, 1000, "e0", 2.0),
        RequestResult("r", False, None, None, None, 1000, None, "e1", 3.0, "boom"),
    ]
    prefill = metrics.computed_prefill(results, ["e0", "e1", "e2"])
    assert prefill == {"e0": 1500, "e1": 1000, "e2": 0}
    rec = metrics.summarize(
        "r",
        "w",
        results,
        oracle_hit_ratio=0.5,
        prefill_tokens_per_engine=prefill,
        router_cpu_s=1.25,
        duration_s=10.0,
        mode="des",
        engines=3,
        profile="p",
        offered_rps=0.4,
    )
    assert rec.ttft_p50_ms == 200.0 and rec.ttft_p99_ms == 300.0
    assert rec.itl_p50_ms == 10.0
    assert rec.errors == 1 and rec.requests == 4
    assert rec.hit_ratio == 0.375 and rec.captured_reuse == 0.75
    assert rec.imbalance == 1.8 and rec.throughput_rps == 0.3
    row = rec.to_json()
    assert tuple(row)[: len(metrics.CORE_KEYS)] == metrics.CORE_KEYS
    assert json.loads(json.dumps(row)) == row
    assert RunRecord.from_json(row).to_json() == row
    assert metrics.mean_itl(1.0, 2.0, 11) == pytest.approx(0.1)
    assert metrics.mean_itl(1.0, 1.0, 1) is None
    assert "hit" in metrics.format_table([rec])
    assert not math.isnan(rec.ttft_mean_ms or math.nan)
