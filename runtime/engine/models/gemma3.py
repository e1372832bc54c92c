"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``): the Gemma 2 model with

- per-head q/k norms of Gemma's unit-offset form before RoPE (the family table's ``qk_norm``);
- five windowed layers to each full one (the family's window rule, or the config's
  ``layer_types`` / ``sliding_window_pattern``), the windowed ones with their own RoPE base
  (``rope_local_base_freq``, ``ModelConfig.rope_local``) and the full ones with the config's
  scaling, if any;
- no soft-capping by default (the config's ``final_logit_softcapping`` / ``attn_logit_softcapping``
  are honoured where set).

Each of these is read from the config by the shared Gemma classes (``gemma2``); this class exists so
that the registry names Gemma 3's implementation, which later differences (its multimodal
checkpoints' weight prefixes) will land in.
"""

from __future__ import annotations

from runtime.engine.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder (see the module docstring)."""
