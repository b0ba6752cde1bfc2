"""Programs the tests run for real beside them: built once by a setup script, then
started with their output in a log file and stopped at the end of the test."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def built_tool(script: str, timeout_s: float) -> str:
    """The binary ``scripts/<script>`` builds or finds (printed path); the test skips with
    the script's reason when it cannot build here (exit 3: no Go toolchain)."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / script)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode == 3:
        pytest.skip(f"{script}: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@contextlib.contextmanager
def logged_process(
    argv: list[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` running with its output in ``log``; terminated at the end (killed if it
    has not left within 20 s)."""
    with log.open("w") as sink:
        proc = subprocess.Popen(
            argv,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
        )
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def tail(log: Path, chars: int = 3000) -> str:
    """The end of a process's log, for an assertion's message."""
    return log.read_text(errors="replace")[-chars:]
