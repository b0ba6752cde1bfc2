"""The legs' bodies for NIXL, Mooncake and SGLang, as the engines expect them
(docs/pd.md; vLLM 0.33 proxies, SGLang's router)."""

from __future__ import annotations

import pytest
from kvplane.router.pd import protocols as pr

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_completion_tokens": 64,
    "min_tokens": 3,
    "temperature": 0.5,
}


def test_nixl_prefill_leg_is_one_non_streaming_token_asking_for_remote_decode() -> None:
    body = pr.nixl_prefill_body(CHAT)
    assert body["stream"] is False
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in body
    assert body["temperature"] == 0.5 and body["messages"] == CHAT["messages"]
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    # the client's body is left as it was
    assert CHAT["stream"] is True and "kv_transfer_params" not in CHAT
    # a completion without max_completion_tokens does not gain one
    assert "max_completion_tokens" not in pr.nixl_prefill_body({"prompt": "x", "max_tokens": 9})


# What vLLM 0.33's NIXL prefill pod returns (pull_scheduler.request_finished).
NIXL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "6a4c380b",
    "remote_request_id": "cmpl-37ce-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 81,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def test_nixl_decode_leg_is_the_original_request_with_the_params_verbatim() -> None:
    params = pr.kv_transfer_params({"choices": [], "kv_transfer_params": NIXL_ANSWER})
    assert params == NIXL_ANSWER
    body = pr.nixl_decode_body(CHAT, NIXL_ANSWER)
    assert body["kv_transfer_params"] == NIXL_ANSWER
    assert body["stream"] is True and body["max_completion_tokens"] == 64
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": []},
        {"kv_transfer_params": None},  # prompt shorter than a block
        {"kv_transfer_params": {**NIXL_ANSWER, "remote_host": None}},
        {"kv_transfer_params": "x"},
        [1],
        None,
    ],
)
def test_an_answer_without_a_usable_handle_is_no_handoff(answer: object) -> None:
    assert pr.kv_transfer_params(answer) is None


def test_mooncake_legs_share_a_transfer_id_and_name_the_bootstrap_server() -> None:
    xfer = pr.transfer_id("req-1")
    assert xfer == "xfer-req-1" and pr.transfer_id("req-1", 2) == "xfer-req-1-2"
    p = pr.mooncake_prefill_body(CHAT, xfer)
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": xfer,
    }
    assert p["stream"] is False and p["max_tokens"] == 1
    addr = pr.bootstrap_addr("http://10.0.0.7:8000", 8998)
    d = pr.mooncake_decode_body(CHAT, xfer, addr, "eng-0")
    assert d["kv_transfer_params"] == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": "http://10.0.0.7:8998",
        "remote_engine_id": "eng-0",
        "transfer_id": xfer,
    }
    assert d["stream"] is True and d["max_completion_tokens"] == 64


def test_mooncake_query_gives_engine_ids_per_dp_rank() -> None:
    # MooncakeBootstrapServer.query: {dp_rank: EngineEntry(engine_id, worker_addr)}
    q = {
        "0": {"engine_id": "e0", "worker_addr": {"0": {"0": "10.0.0.7:17000"}}},
        "1": {"engine_id": "e1", "worker_addr": {"0": {"0": "10.0.0.7:17001"}}},
    }
    ids = pr.mooncake_engine_ids(q)
    assert ids == {0: "e0", 1: "e1"}
    assert pr.pick_dp_rank(ids, "abc") in (0, 1)
    assert pr.pick_dp_rank({0: "e0"}, "anything") == 0
    bad_answers: list[object] = [{}, [], {"0": {"worker_addr": {}}}]
    for bad in bad_answers:
        with pytest.raises(ValueError):
            pr.mooncake_engine_ids(bad)


def test_ipv6_hosts() -> None:
    assert pr.host_of("http://[fd00::7]:8000") == "fd00::7"
    assert pr.bootstrap_addr("http://[fd00::7]:8000", 8998) == "http://[fd00::7]:8998"
    with pytest.raises(ValueError):
        pr.host_of("not a url")


def test_sglang_body_carries_bootstrap_fields_for_both_legs() -> None:
    room = pr.bootstrap_room()
    assert 0 <= room < 2**63
    body = pr.sglang_body(CHAT, "10.0.0.7", 8998, room)
    assert body["bootstrap_host"] == "10.0.0.7"
    assert body["bootstrap_port"] == 8998 and body["bootstrap_room"] == room
    assert body["stream"] is True and body["max_completion_tokens"] == 64  # untouched
    batch = {"model": "m", "prompt": ["a", "b", "c"]}
    assert pr.batch_size(batch) == 3 and pr.batch_size({"prompt": [1, 2, 3]}) is None
    rooms = [1, 2, 3]
    lists = pr.sglang_body(batch, "h", 1, rooms)
    assert lists["bootstrap_host"] == ["h"] * 3 and lists["bootstrap_room"] == rooms


def test_several_sequences_per_request() -> None:
    assert pr.multi_sequence({"n": 2, "prompt": "x"})
    assert pr.multi_sequence({"prompt": ["a", "b"]})
    assert pr.multi_sequence({"prompt": [[1, 2], [3]]})
    assert not pr.multi_sequence({"n": 1, "prompt": [1, 2, 3]})
    assert not pr.multi_sequence(CHAT)
