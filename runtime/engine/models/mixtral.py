"""Mixtral: the sparse Llama decoder (``qwen_moe``) under Mixtral's checkpoint names.

Every layer is sparse (top-2 of 8 experts in the released models), the top-k weights are always
renormalised and stay in fp32 when they scale the experts (the family table's ``MoeKeys``), and a
``sliding_window`` windows every layer (Mistral's rule). The checkpoint calls the sparse block
``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down);
``checkpoint_name`` maps them to the shared block's names.
"""

from __future__ import annotations

import re

from runtime.engine.models.qwen_moe import QwenMoeForCausalLM

_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_TENSOR = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.")


class MixtralForCausalLM(QwenMoeForCausalLM):
    """Mixtral's checkpoints on the shared sparse layers."""

    def checkpoint_name(self, name: str) -> str:
        name = _EXPERT_TENSOR.sub(lambda m: f".mlp.experts.{m.group(1)}.{_EXPERT_PROJECTIONS[m.group(2)]}.", name)
        return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
