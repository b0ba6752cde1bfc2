"""A tiny LoRA adapter for the tiny model (``tiny_model.py``), in PEFT's format.

Rank 8 on ``q_proj`` and ``v_proj`` of both layers, random weights from a seed, written
as PEFT writes an adapter (``adapter_config.json`` + ``adapter_model.safetensors`` with
``base_model.model.model.layers.N.self_attn.X.lora_A/B.weight`` tensors), which is what
vLLM's ``--lora-modules name=path`` loads. Written with torch and safetensors directly
(the vLLM virtualenv has both), so neither ``peft`` nor a download is needed.

From the dev virtualenv call :func:`write_tiny_lora`, which runs this file under the
vLLM virtualenv's python.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RANK = 8
HIDDEN = 128  # tiny_model: hidden size 128
OUT_FEATURES = {"q_proj": 128, "v_proj": 64}  # 2 heads x 64, 1 KV head x 64
LAYERS = 2

CONFIG = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": RANK,
    "lora_alpha": 2 * RANK,
    "lora_dropout": 0.0,
    "bias": "none",
    "target_modules": sorted(OUT_FEATURES),
    "base_model_name_or_path": "tiny",
}


def build(out_dir: Path, seed: int = 0) -> Path:
    """Write the adapter into ``out_dir`` (needs torch and safetensors)."""
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, out in OUT_FEATURES.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=gen) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.01
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(CONFIG, indent=2))
    return out_dir


def write_tiny_lora(out_dir: Path, *, seed: int = 0, timeout: float = 300.0) -> Path:
    """Build the adapter into ``out_dir`` with the vLLM virtualenv's python."""
    from kvplane.local.tiny_model import vllm_python

    subprocess.run(
        [str(vllm_python()), "-P", str(Path(__file__).resolve()), str(out_dir), str(seed)],
        check=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )
    return out_dir


if __name__ == "__main__":
    build(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
