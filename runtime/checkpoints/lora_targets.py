"""The checkpoint projections a LoRA adapter may adapt, by the names PEFT folders use (torch-free).

Attention and the dense MLP, plus the fused names of checkpoints that store them fused (Phi-3's
``qkv_proj``, ``gate_up_proj``). Both the flags (``--lora-target-modules``) and the engine's slots
(``runtime.engine.lora.pool``) read this one list.
"""

from __future__ import annotations

LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
)
