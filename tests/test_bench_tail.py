"""`kvplane bench tail` on a real run's saved requests (a small discrete-event run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.bench import routing, tail
from kvplane.workload.results import RequestResult

pytestmark = pytest.mark.timeout(300)

SHAPE = "long-doc-qa:documents=4,repeat_count=3"
WORKLOAD = ["--workload", "long-doc-qa", "--limit", "12", "--rate-scale", "0.5"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tail")
    argv = ["--mode", "des", "--routers", "kvplane", "--workloads", "long-doc-qa"]
    argv += ["--shape", SHAPE, "--limit", "12", "--rate-scale", "0.5", "--engines", "2"]
    argv += ["--out-dir", str(out), "--no-progress", "--save-requests", str(out / "req")]
    assert routing.main(argv) == 0
    (path,) = (out / "req").glob("*.jsonl.xz")
    return path


def _rows(out: str) -> list[list[str]]:
    """The table's rows: TTFT, prompt, cached, oracle cached, ..., cause."""
    lines = [ln for ln in out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_tail_of_a_shaped_workload(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tail.main([str(saved), *WORKLOAD, "--shape", SHAPE, "--percentile", "0"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert len(rows) == 12
    # 4 documents read 3 times each: 8 requests the oracle serves from cache, and at half
    # load the router serves them from where the first reading left them
    repeats = [r for r in rows if int(r[3]) > int(r[1]) // 2]
    assert len(repeats) == 8
    assert all(int(r[2]) >= int(r[3]) - 64 for r in repeats)
    # the slowest are first readings: their own prefill is their TTFT
    assert rows[0][-1] == "long prompt" and int(rows[0][3]) < int(rows[0][1]) // 2
    # what was in flight where each arrived: never fewer on its pod than the fewest
    # anywhere, and the summary counts the arrivals that found an idle pod
    flights = [(int(r[-3]), int(r[-2])) for r in rows]
    assert all(least <= mine for mine, least in flights)
    idle = sum(1 for _, least in flights if least == 0)
    taken = sum(1 for mine, _ in flights if mine == 0)
    assert f"{idle} arrived while a pod had nothing in flight, {taken} of them" in out
    # the same name and size without the run's shape is another workload, read wrongly
    assert tail.main([str(saved), *WORKLOAD, "--percentile", "0"]) == 0
    assert [r[3] for r in _rows(capsys.readouterr().out)] != [r[3] for r in rows]


def test_tail_refuses_results_of_another_slice(saved: Path) -> None:
    other = [str(saved), "--workload", "long-doc-qa", "--limit", "12", "--rate-scale", "1"]
    with pytest.raises(ValueError, match="do not match"):
        tail.main([*other, "--shape", SHAPE])


def test_tail_in_the_time_of_the_run_it_reads(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--run``: a mocker run's floor and own prefill come from the mocker's measured
    grid recorded in that run's JSON, not from the simulator's profile."""

    def ms(new: int, cached: int) -> float:  # linear: the grid's interpolation is exact
        return 5.0 + 0.01 * new + 0.001 * cached

    news, cacheds = (64, 1024, 4096), (0, 1024)
    grid = {"new": news, "cached": cacheds, "ms": [[ms(n, c) for c in cacheds] for n in news]}
    run = tmp_path / "routing-run.json"
    setup = {"profile": "h100-llama-3.1-8b", "block size": 64, "fleet": "dynamo-mocker"}
    run.write_text(json.dumps({"setup": setup, "mocker_floor_grid": grid}))
    argv = [str(saved), *WORKLOAD, "--shape", SHAPE, "--percentile", "0"]
    assert tail.main([*argv, "--run", str(run)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 12
    for r in rows:
        prompt, cached, oracle = int(r[1]), int(r[2]), int(r[3])
        assert int(r[4]) == round(ms(prompt - oracle, oracle))  # floor
        assert int(r[5]) == round(ms(prompt - cached, cached))  # own prefill
    # without it, the same requests are read in the simulator's time
    assert tail.main(argv) == 0
    assert [r[4] for r in _rows(capsys.readouterr().out)] != [r[4] for r in rows]


def test_in_flight_counts_from_arrival_to_last_token() -> None:
    """A request is in flight on its pod from its arrival to its last token (its first
    where it reports no end); the one arriving is not counted against itself."""

    def done(pod: str, arrival: float, ttft: float, e2e: float | None) -> RequestResult:
        return RequestResult("r", True, ttft_s=ttft, e2e_s=e2e, backend=pod, arrival_s=arrival)

    flights = tail.InFlight(
        [
            done("a", 0.0, 0.1, 1.0),  # a: in flight over [0, 1)
            done("a", 0.5, 0.1, 1.0),  # a: [0.5, 1.5)
            done("b", 0.2, 0.3, None),  # b: [0.2, 0.5), no end reported
            RequestResult("r", False, backend="b", arrival_s=0.3, error="x"),  # not counted
        ]
    )
    assert flights.at("a", 0.7) == 2 and flights.at("b", 0.7) == 0
    assert flights.at("a", 0.5) == 1  # only what arrived before: not the one arriving
    assert flights.at("b", 0.4) == 1 and flights.least(0.4) == 1
    assert flights.least(1.2) == 0 and flights.at("a", 1.2) == 1
