"""GGUF checkpoints (llama.cpp's single-file format): metadata, tokenizer and tensors.

A GGUF file is turned once, in ``launch.py`` before any child starts, into a small
checkpoint folder in the tinyserve cache (``prepare.py``): an HF-style ``config.json``
made from the file's metadata (``config.py``), the tokenizer and chat template that
transformers converts from it, and ``gguf.json``, the index of the file's tensors. Every
process then reads that folder as it reads any checkpoint; the scheduler's weight loader
memory-maps the GGUF file itself and dequantizes each tensor, or only its rank's shard of
it, with the ``gguf`` package (``runtime.engine.loading.gguf_tensors``).
"""
