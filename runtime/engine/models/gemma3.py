"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``, and the text model of the
multimodal ``Gemma3ForConditionalGeneration`` checkpoints, 4B and up): the Gemma 2 model with

- per-head q/k norms of Gemma's unit-offset form before RoPE (the family table's ``qk_norm``);
- five windowed layers to each full one (the family's window rule, or the config's
  ``layer_types`` / ``sliding_window_pattern``), the windowed ones with their own RoPE base
  (``rope_local_base_freq``, ``GemmaConfig.rope_local``) and the full ones with the config's
  scaling, if any;
- no soft-capping by default (the config's ``final_logit_softcapping`` / ``attn_logit_softcapping``
  are honoured where set).

Each of these is read from the config by the shared Gemma classes (``gemma2``). What is Gemma 3's
own: a multimodal checkpoint nests the text model's weights under a prefix (``language_model.``
before transformers 5, ``model.language_model.`` since), mapped back here; its vision tower and
projector are not read (its config's nested ``text_config`` is read by ``model_config``).
"""

from __future__ import annotations

from runtime.engine.models.gemma2 import Gemma2ForCausalLM

# a multimodal checkpoint's prefix of the text model's tensors -> ours
_TEXT_MODEL_PREFIXES = (
    ("model.language_model.", "model."),  # transformers 5
    ("language_model.model.", "model."),  # transformers 4
    ("language_model.lm_head.", "lm_head."),
)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder (see the module docstring)."""

    def checkpoint_name(self, name: str) -> str:
        for prefix, ours in _TEXT_MODEL_PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return name
