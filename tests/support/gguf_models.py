"""Serving a GGUF test file both ways: our model runner over the folder prepared from it, and
transformers' own GGUF loading of the same file (the judge, sharing no code with ours). The GGUF
test modules (per family) all compare these two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.engine.model_runner import ModelRunner


def gguf_runner(path: Path, **kwargs: Any) -> ModelRunner:
    """Our CPU fp32 runner (torch_native attention unless ``kwargs`` say otherwise) over ``path``:
    a GGUF file (prepared into the cache on first use) or a checkpoint folder."""
    kwargs.setdefault("attention_backend", "torch_native")
    kwargs.setdefault("max_total_tokens", 1024)
    return ModelRunner(path, device="cpu", dtype="float32", load_progress=False, **kwargs)


def transformers_gguf(path: Path, eager: bool = False) -> Any:
    """transformers' fp32 model loaded from the GGUF file ``path``, eval mode. ``eager``: attention
    computed eagerly (a soft-capped model's: SDPA has no soft-cap)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager" if eager else None
    )
    return model.eval()
