"""`kvplane bench tail` on a real run's saved requests (a small discrete-event run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.bench import routing, tail

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
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 12
    # 4 documents read 3 times each: 8 requests the oracle serves from cache, and at half
    # load the router serves them from where the first reading left them
    repeats = [r for r in rows if int(r[3]) > int(r[1]) // 2]
    assert len(repeats) == 8
    assert all(int(r[2]) >= int(r[3]) - 64 for r in repeats)
    # the slowest are first readings: their own prefill is their TTFT
    assert rows[0][-1] == "long prompt" and int(rows[0][3]) < int(rows[0][1]) // 2
    # the same name and size without the run's shape is another workload, read wrongly
    assert tail.main([str(saved), *WORKLOAD, "--percentile", "0"]) == 0
    assert [r[3] for r in _rows(capsys.readouterr().out)] != [r[3] for r in rows]


def test_tail_refuses_results_of_another_slice(saved: Path) -> None:
    other = [str(saved), "--workload", "long-doc-qa", "--limit", "12", "--rate-scale", "1"]
    with pytest.raises(ValueError, match="do not match"):
        tail.main([*other, "--shape", SHAPE])
