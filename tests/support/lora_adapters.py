"""LoRA adapters for the tests, made with ``peft`` over a checkpoint, and peft's own model as the oracle.

Adapters are made with ``init_lora_weights=False`` (both matrices random, so the adapter changes the
model from its first use) under a fixed seed, saved as PEFT folders exactly as users get them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.checkpoints import load_hf_model


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter adapts: its rank, alpha, target modules and PEFT's per-module patterns."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    seed: int = 0
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    rslora: bool = False
    scale: float = 1.0  # multiplies every LoRA matrix (a tiny model's random adapter at peft's init is small)


def build_adapter(base: str | Path | Any, out_dir: str | Path, spec: AdapterSpec) -> Path:
    """A PEFT adapter folder made by ``spec`` (reproducible: ``spec.seed``) for checkpoint folder ``base``,
    or for a model of transformers config ``base`` (an adapter's matrices do not depend on the base
    weights: a real model's adapters are made on a randomly initialised model of its config)."""
    from peft import LoraConfig, get_peft_model

    out = Path(out_dir)
    if (out / "adapter_config.json").is_file():
        return out
    torch.manual_seed(spec.seed)
    if isinstance(base, (str, Path)):
        model = load_hf_model(base)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(base, dtype=torch.float32)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        init_lora_weights=False,
        rank_pattern=dict(spec.rank_pattern),
        alpha_pattern=dict(spec.alpha_pattern),
        use_rslora=spec.rslora,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    if spec.scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.mul_(spec.scale)
    peft_model.save_pretrained(str(out))
    return out


_REFERENCES: dict[tuple[Path, Path | None], Any] = {}


def peft_model(base: str | Path, adapter: str | Path | None) -> Any:
    """transformers' model of ``base`` with ``adapter`` applied by peft (None: the base alone), fp32, eval."""
    key = (Path(base), Path(adapter) if adapter is not None else None)
    if key not in _REFERENCES:
        model = load_hf_model(base)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter)).eval()
        _REFERENCES[key] = model
    return _REFERENCES[key]
