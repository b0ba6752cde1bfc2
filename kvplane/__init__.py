"""kvplane: a cluster-wide KV cache for vLLM and SGLang fleets.

The distribution maps the top-level folders ``router/`` and ``operator/`` to
``kvplane.router`` and ``kvplane.operator`` (see pyproject.toml). In a source
checkout imported without installation, extend the package path to the repo
root so the same imports work; an installed wheel never takes this branch.
"""

from pathlib import Path as _Path

_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "router" / "__init__.py").is_file():
    __path__.append(str(_root))

__version__ = "0.1.0"
