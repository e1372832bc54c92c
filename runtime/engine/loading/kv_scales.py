"""The per-layer K/V scales an fp8 KV cache divides by, when the checkpoint carries them.

Checkpoints quantized for an fp8 KV cache (llm-compressor, ModelOpt, AutoFP8) store one scale per
layer for K and one for V, under the names vLLM and SGLang read: ``model.layers.N.self_attn.k_scale``
/ ``v_scale`` (also under ``self_attn.attn.``), or the older ``self_attn.k_proj.output_scale`` /
``v_proj.output_scale``, or one ``self_attn.kv_scale`` for both. Without them every scale is 1.0 (the
values are stored as they are, saturated at the format's largest). Only the safetensors headers are
read (names, then the few scalars named); a GGUF file carries no such scales.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from safetensors import safe_open

from runtime.checkpoints.gguf.prepare import is_gguf_folder
from runtime.engine.loading.weight_loader import checkpoint_files

logger = logging.getLogger(__name__)

# (K or V or both, the pattern of a layer's scale name): the first pattern that names a layer wins
_SCALE_NAMES = (
    ("k", re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?k_scale$")),
    ("v", re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?v_scale$")),
    ("k", re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.k_proj\.output_scale$")),
    ("v", re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.v_proj\.output_scale$")),
    ("kv", re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?kv_scale$")),
)


def checkpoint_kv_scales(folder: str | Path, num_layers: int) -> tuple[list[float], list[float]] | None:
    """``(k_scales, v_scales)`` per layer from the checkpoint in ``folder``, or None where it names
    none (a layer it leaves out keeps 1.0). A scale that is not one positive number is an error naming it."""
    if is_gguf_folder(Path(folder)):
        return None
    k_scales: list[float | None] = [None] * num_layers
    v_scales: list[float | None] = [None] * num_layers
    found = False
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                for which, pattern in _SCALE_NAMES:
                    match = pattern.search(name)
                    if match is None or int(match.group(1)) >= num_layers:
                        continue
                    value = handle.get_tensor(name).float()
                    if value.numel() != 1 or not float(value) > 0:
                        raise ValueError(f"KV cache scale {name} must be one positive number, got {value.tolist()}")
                    layer = int(match.group(1))
                    for target, key in ((k_scales, "k"), (v_scales, "v")):
                        if key in which and target[layer] is None:
                            target[layer] = float(value)
                    found = True
                    break
    if not found:
        return None
    logger.info("KV cache scales from the checkpoint: %d layers", sum(s is not None for s in k_scales))
    return [s or 1.0 for s in k_scales], [s or 1.0 for s in v_scales]
