"""The model's own sampling defaults: what a checkpoint recommends for the fields a request leaves unset.

A request that sets no ``temperature`` would otherwise be sampled at 1.0 (OpenAI's and SGLang's
built-in default), which makes a small instruct model ramble: SGLang and vLLM therefore take the
model's ``generation_config.json`` values instead (SGLang's ``--sampling-defaults model``, its
default). This module reads them, the way SGLang's ``ModelConfig.get_default_sampling_params`` does,
for the same fields only (``SAMPLING_DEFAULT_FIELDS``: ``max_new_tokens``, ``stop``, ``n`` are the
request's business, never the model's), with two differences:

- only the keys the file itself sets count: transformers' ``GenerationConfig.to_dict()``, which
  SGLang reads, also carries the library's own defaults (``top_k`` 50), which no model author chose;
- a value this server would refuse (a ``top_p`` of 0, a string) is dropped with a reason, so that a
  request never fails on a field its client did not send.

``do_sample`` is ignored, as SGLang and vLLM ignore it: the file's ``temperature`` decides.

GGUF files have no ``generation_config.json``; ``prepare_gguf`` writes one into the prepared folder
from the file's llama.cpp sampler metadata (``GGUF_SAMPLING_KEYS``), else, for a model tinyserve
ships, from ``SMOLLM2_SAMPLING_DEFAULTS``: the one place a shipped model's defaults are written down.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from runtime.protocol.sampling_params import SamplingParams, SamplingParamsError

GENERATION_CONFIG = "generation_config.json"
# The generation_config.json keys that become request defaults (SGLang's list), in SamplingParams' names.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# SmolLM2-135M-Instruct (the default model, ``smollm2-135m-instruct``): its GGUF file carries no sampler
# metadata and its Hugging Face generation_config.json none either; its model card
# (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) generates with temperature 0.2 and top_p 0.9.
SMOLLM2_SAMPLING_DEFAULTS: Mapping[str, float] = {"temperature": 0.2, "top_p": 0.9}

# llama.cpp's sampler metadata (gguf-py's Keys.General.SAMPLING_*) -> generation_config.json names.
# llama.cpp's penalty_repeat covers the last penalty_last_n tokens, ours (HF's) the whole sequence:
# the nearest field we have. The other llama.cpp samplers (xtc, mirostat, sequence) have no field here.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class ModelSampling:
    """The defaults a checkpoint folder recommends: ``values`` (SamplingParams names, checked), the file
    they came from (None: the folder has no generation_config.json) and what was dropped, and why."""

    values: dict[str, float | int] = field(default_factory=dict)
    source: str | None = None
    ignored: dict[str, str] = field(default_factory=dict)


def gguf_sampling(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A GGUF file's sampler metadata in generation_config.json names ({} when it has none). Floats are
    f32 in the file: 0.9 reads 0.8999999761581543, so they are rounded to the 6 digits f32 carries."""
    out: dict[str, Any] = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = metadata.get(key)
        if isinstance(value, float):
            value = float(f"{value:.6g}")
        if value is not None:
            out[name] = value
    return out


def read_model_sampling(folder: str | Path) -> ModelSampling:
    """The sampling defaults of the checkpoint ``folder`` (see the module docstring). A file that is
    not a JSON object gives none, with the reason in ``ignored`` (the server must start regardless)."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return ModelSampling()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return ModelSampling(source=str(path), ignored={GENERATION_CONFIG: f"unreadable: {exc}"})
    if not isinstance(config, dict):
        return ModelSampling(source=str(path), ignored={GENERATION_CONFIG: "not a JSON object"})
    values: dict[str, float | int] = {}
    ignored: dict[str, str] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        raw = config.get(name)
        if raw is None:
            continue
        try:
            values[name] = _checked(name, raw)
        except SamplingParamsError as exc:
            ignored[name] = str(exc)
    return ModelSampling(values, str(path), ignored)


def _checked(name: str, raw: Any) -> float | int:
    """``raw`` as SamplingParams takes it, or SamplingParamsError. A ``top_k`` of 0 or less is "off" in
    transformers and llama.cpp alike (-1 here), and an integral float is an integer count."""
    value = raw
    if name == "top_k" and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        if math.isfinite(raw) and raw == int(raw):
            value = -1 if raw <= 0 else int(raw)
    params = SamplingParams.from_dict({name: value})  # type and range, as a request's own value is checked
    result: float | int = getattr(params, name)
    return result
