"""Phi-3 family decoder (Phi-3-mini, Phi-3.5-mini, Phi-4-mini): the Llama decoder with the
checkpoint's fused projections.

Phi-3's layers are Llama's (pre-norm RMSNorm, rotate-half RoPE, silu-gated MLP, no biases); what
differs is read elsewhere: partial rotary (Phi-4-mini rotates 3/4 of each head's dims) and LongRoPE
scaling (Phi-3.5, Phi-4-mini) are the rotary tables' (``runtime.engine.layers.rotary``), the window
every layer attends within (Phi-3-mini-4k) is the family's rule. The one thing this class owns is
the checkpoint layout: HF Phi-3 checkpoints (and llama.cpp's ``phi3`` GGUF files) store
``self_attn.qkv_proj`` (q rows, then k, then v) and ``mlp.gate_up_proj`` (gate rows, then up) as
single tensors, which are exactly our merged layers' full matrices. Each is loaded under its own
name with no shard id, which makes the merged layer's loader cut it into its parts
(``runtime.engine.layers.linear.WeightRows``) and give each part its TP rank's rows, as it does for
separate q/k/v or gate/up tensors: a rank holds its query heads, its KV heads and its slice of
the intermediate features, and reads only those rows from the file.
"""

from __future__ import annotations

from runtime.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` loading the fused ``qkv_proj`` / ``gate_up_proj`` tensors of a Phi-3
    checkpoint: every parameter under its own name, shard id None (a merged layer's whole matrix)."""

    stacked_checkpoint_names: dict[str, tuple[str, object]] = {}
