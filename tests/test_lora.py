"""LoRA adapters, the pure parts: key namespaces, vLLM's adapter metric, the adapter
term of the cost, adapters as served models. The real engine is in test_lora_vllm.py."""

from __future__ import annotations

import pytest
from kvplane.router.blockkeys import adapter_root, block_keys, generation_root
from kvplane.router.config import CostParams, RouterConfig
from kvplane.router.cost import CostModel, PodLoad, adapter_load_ms
from kvplane.router.engine_stats import LoraState, parse_metrics
from kvplane.router.models import parse_pools
from kvplane.router.policies.cost import choose_by_cost
from kvplane.router.tiers import Tier

ROOT = generation_root("gen-a")

# vLLM 0.32's page (running with --enable-lora --max-loras 2): one series per label set
# it has ever set, each valued at the time it was set; the newest is the state now.
LORA = "vllm:lora_requests_info"
LORA_PAGE = "\n".join(
    [
        f"# HELP {LORA} Running stats on lora requests.",
        f"# TYPE {LORA} gauge",
        f'{LORA}{{max_lora="2",running_lora_adapters="ada",waiting_lora_adapters="ada"}} '
        "1.7955949219974878e+09",
        f'{LORA}{{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}} '
        "1.7955949221068447e+09",
        f'{LORA}{{max_lora="2",running_lora_adapters="ada,bob",waiting_lora_adapters="cy"}} '
        "1.7955949220e+09",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 1.0',
        "",
    ]
)


def test_adapters_and_the_base_model_never_share_keys() -> None:
    toks = list(range(64))
    base = block_keys(toks, 16, ROOT)
    ada = block_keys(toks, 16, adapter_root(ROOT, "ada"))
    bob = block_keys(toks, 16, adapter_root(ROOT, "bob"))
    assert adapter_root(ROOT, None) == ROOT
    assert not set(base) & set(ada) and not set(ada) & set(bob) and not set(base) & set(bob)
    assert block_keys(toks, 16, adapter_root(ROOT, "ada")) == ada  # a pure function
    other_gen = block_keys(toks, 16, adapter_root(generation_root("gen-b"), "ada"))
    assert not set(ada) & set(other_gen)


def test_lora_state_is_the_newest_series() -> None:
    stats = parse_metrics(LORA_PAGE)
    assert stats.running == 1.0
    assert stats.lora == LoraState(frozenset(), frozenset(), 2)
    older = LORA_PAGE.replace("1.7955949221068447e+09", "1.0")
    assert parse_metrics(older).lora == LoraState(frozenset({"ada", "bob"}), frozenset({"cy"}), 2)
    assert parse_metrics('vllm:num_requests_running{engine="0"} 1.0\n').lora is None
    bad = 'vllm:lora_requests_info{max_lora="x",running_lora_adapters=""} 1.0\n'
    assert parse_metrics(bad).lora is None


P = CostParams(adapter_load_ms=25.0, adapter_slot_wait_ms=500.0)


@pytest.mark.parametrize(
    ("lora", "ms"),
    [
        (LoraState(frozenset({"ada"}), frozenset(), 1), 0.0),  # running there: loaded
        (LoraState(frozenset(), frozenset(), 2), 25.0),  # a free slot: load it
        (LoraState(frozenset({"bob"}), frozenset(), 2), 25.0),
        (LoraState(frozenset({"bob"}), frozenset({"ada"}), 2), 25.0),  # queued, slot free
        (LoraState(frozenset({"bob", "cy"}), frozenset(), 2), 525.0),  # slots all taken
        (LoraState(frozenset({"bob"}), frozenset({"cy", "ada"}), 2), 525.0),
        (None, 25.0),  # no LoRA state reported: the load is charged
    ],
)
def test_adapter_term(lora: LoraState | None, ms: float) -> None:
    assert adapter_load_ms("ada", lora, P) == ms
    assert adapter_load_ms(None, lora, P) == 0.0  # base-model requests never pay it


def test_the_adapter_term_is_part_of_the_predicted_ttft() -> None:
    model = CostModel(P, 16, 1000)
    full = PodLoad(lora=LoraState(frozenset({"bob", "cy"}), frozenset(), 2))
    t = model.predict("p", 100, {}, full, "ada")
    assert t.adapter_ms == 525.0
    assert t.ttft_ms == pytest.approx(t.queue_ms + t.recompute_ms + 525.0)
    assert model.predict("p", 100, {}, full).adapter_ms == 0.0


def test_an_adapter_request_goes_where_its_adapter_runs_all_else_equal() -> None:
    model = CostModel(P, 16, 1000)
    loads = {
        "a": PodLoad(lora=LoraState(frozenset({"bob"}), frozenset(), 1)),
        "b": PodLoad(lora=LoraState(frozenset({"ada"}), frozenset(), 1)),
    }
    no_match: dict[str, dict[Tier, int]] = {}
    assert choose_by_cost(model, 64, no_match, loads, "ada").pod == "b"
    assert choose_by_cost(model, 64, no_match, loads, "bob").pod == "a"


def test_adapters_are_served_models_of_one_pool() -> None:
    def pool(name: str, adapters: list[str]) -> dict[str, object]:
        return {
            "pool": name,
            "model": {"name": name, "tokenizer": "/t", "lora_adapters": adapters},
            "backends": [{"name": "e0", "url": "http://127.0.0.1:1"}],
        }

    configs = parse_pools({"pools": [pool("m1", ["ada"]), pool("m2", ["bob"])]})
    assert [c.model.lora_adapters for c in configs] == [["ada"], ["bob"]]
    with pytest.raises(ValueError, match="served twice"):
        parse_pools({"pools": [pool("m1", ["ada"]), pool("m2", ["ada"])]})
    with pytest.raises(ValueError, match="served twice"):
        parse_pools({"pools": [pool("m1", ["m2"]), pool("m2", [])]})
    assert RouterConfig.model_validate(pool("m1", [])).model.lora_adapters == []
