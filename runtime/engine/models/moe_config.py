"""A mixture of experts' own config (Qwen2-MoE, Qwen3-MoE, Mixtral; OLMoE's adds to it): its
sparse MLP layers, read into the sparse layer's ``MoeConfig`` (``runtime.engine.config_reading``).

How each family's config.json names its experts is the family table's ``MoeKeys``
(``runtime.checkpoints.families``); the layers are sparse as transformers builds them: every layer
unless it is in ``mlp_only_layers`` or ``decoder_sparse_step`` skips it. A config whose expert count
is 0 is dense (``moe`` None). ``--ep-size`` must split the experts evenly. Read without torch,
beside the model that uses it (``qwen_moe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from runtime.engine.config_reading import ConfigReading, FamilyConfig, MoeConfig, UnsupportedModelError


@dataclass(frozen=True)
class MoeFamilyConfig(FamilyConfig):
    moe: MoeConfig | None  # the sparse MLP layers; None: the config has no experts (dense)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], reading: ConfigReading) -> MoeFamilyConfig:
        return cls(moe=read_moe(raw, reading))

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe is not None else 0


def read_moe(raw: Mapping[str, Any], reading: ConfigReading) -> MoeConfig | None:
    """The family's sparse MLP layers; None for a config without experts. UnsupportedModelError
    where ``--ep-size`` cannot split the experts or the top-k is not among them."""
    keys = reading.family.moe
    assert keys is not None, f"{reading.family.name} is not a mixture of experts in the family table"
    experts = next((int(raw[k]) for k in keys.experts_keys if raw.get(k) is not None), 0)
    if experts == 0:
        return None
    if experts % reading.ep_size:
        raise UnsupportedModelError(f"{experts} experts cannot be split evenly over --ep-size {reading.ep_size}")
    top_k = int(raw["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok {top_k} is not within 1..{experts}")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense_layers = set(raw.get("mlp_only_layers") or ())
    renormalize = bool(raw.get(keys.renormalize_key, False)) if keys.renormalize_key else True
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(raw[keys.expert_size_key]),
        renormalize=renormalize,
        weights_in_model_dtype=keys.weights_in_model_dtype,
        sparse_layers=tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(reading.num_layers)),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        ep_size=reading.ep_size,
    )
