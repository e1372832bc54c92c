"""The "execution" flags: where and how the model runs (device, dtype, quantized weights, the
attention kernels, CUDA graphs, the seed). The engine reads the values; these flags only name them."""

from __future__ import annotations

import argparse
from typing import Protocol

from runtime.config.flag_checks import choice

DEVICE_CHOICES = ("auto", "cuda", "cpu")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
# runtime.engine.quant.loading.QUANTIZATION_METHODS, plus auto (launch.py's default: the CPU's choice,
# runtime.engine.quant.loading.resolve_quantization) and none (dense)
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "gguf_dual", "int8", "w8a8_int8")
QUANTIZATION_CLI_DEFAULT = "auto"
# How kept-quantized weights multiply their activations on a CPU (runtime/engine/cpu/csrc/quant_linear.c)
QUANTIZED_ACTIVATIONS_CHOICES = ("none", "int8")
ATTENTION_BACKEND_CHOICES = ("auto", "torch_native", "triton")


class ExecutionFlags(Protocol):
    """The ``ServerArgs`` fields of this group (a protocol, so that this module need not import
    ``runtime.config.server_args``, which imports it)."""

    device: str
    dtype: str
    quantization: str | None
    quantized_activations: str
    attention_backend: str
    random_seed: int | None
    disable_cuda_graph: bool
    cuda_graph_max_bs: int | None
    cuda_graph_bs: list[int] | None


def add_execution_args(parser: argparse.ArgumentParser, defaults: ExecutionFlags) -> None:
    """The "execution" group; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("execution")
    g.add_argument(
        "--device",
        type=str,
        default=d.device,
        choices=DEVICE_CHOICES,
        help="auto picks cuda when available, else cpu (default auto)",
    )
    g.add_argument(
        "--dtype",
        type=str,
        default=d.dtype,
        choices=DTYPE_CHOICES,
        help="weight and activation dtype; auto is bfloat16 where supported (default auto)",
    )
    g.add_argument(
        "--quantization",
        type=str,
        default=QUANTIZATION_CLI_DEFAULT,
        choices=QUANTIZATION_CHOICES,
        help="keep weights quantized: gguf keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights in "
        "their blocks; gguf_dual keeps the blocks for decode steps of a few rows and dense values "
        "beside them for prefills and loaded batches (the memory of both); int8 (= w8a8_int8) makes per-channel int8 linears of any checkpoint; "
        "--quantized-activations says how the kept blocks multiply; none: weights dense in --dtype, "
        "a GGUF file's dequantized at load; auto: for a GGUF file with --dtype auto on a CPU, gguf "
        "without native bf16 matmul (AVX2, AVX-512 without BF16) and gguf_dual with it but without "
        "AMX tiles (while both "
        "forms take at most a third of RAM), where each serves one user and a loaded server best, "
        "else none (default auto)",
    )
    g.add_argument(
        "--quantized-activations",
        type=str,
        default=d.quantized_activations,
        choices=QUANTIZED_ACTIVATIONS_CHOICES,
        help="how a weight kept quantized (gguf, gguf_dual) multiplies its activations on a CPU: none "
        "keeps them as they are (weight-only: each block is dequantized in cache, and the answers are the "
        "dense model's); int8 quantizes them per block of 32 for decode steps of a few rows, as llama.cpp "
        "does (integer products: less compute, but a small model's greedy answers can change). The int8 "
        "method's weights always quantize them (default none)",
    )
    g.add_argument(
        "--attention-backend",
        type=str,
        default=d.attention_backend,
        choices=ATTENTION_BACKEND_CHOICES,
        help="auto is triton on cuda and torch_native on cpu (default auto)",
    )
    g.add_argument(
        "--random-seed",
        type=int,
        default=d.random_seed,
        help="seed of the server's random generators (default: unseeded)",
    )
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        default=d.disable_cuda_graph,
        help="run decode eagerly instead of replaying captured CUDA graphs (cuda only)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=d.cuda_graph_max_bs,
        help="largest decode batch captured in a CUDA graph; larger batches run eagerly "
        "(default 256, capped by --max-running-requests)",
    )
    g.add_argument(
        "--cuda-graph-bs",
        type=int,
        nargs="+",
        default=d.cuda_graph_bs,
        metavar="BS",
        help="the decode batch sizes to capture (default 1 2 4 8 16 24 32 ... up to "
        "--cuda-graph-max-bs); a batch is padded to the next captured size",
    )


def check_device_and_dtype(args: ExecutionFlags) -> None:
    """--device, --dtype and --quantization name something the engine knows."""
    choice("--device", args.device, DEVICE_CHOICES)
    choice("--dtype", args.dtype, DTYPE_CHOICES)
    if args.quantization is not None:
        choice("--quantization", args.quantization, QUANTIZATION_CHOICES)
    choice("--quantized-activations", args.quantized_activations, QUANTIZED_ACTIVATIONS_CHOICES)


def check_attention_backend(args: ExecutionFlags) -> None:
    """--attention-backend names a backend the engine has."""
    choice("--attention-backend", args.attention_backend, ATTENTION_BACKEND_CHOICES)


def check_cuda_graph_bs(args: ExecutionFlags) -> None:
    """An empty or non-positive capture list would leave decode with no graph to pad a batch to."""
    if args.cuda_graph_bs is not None:
        if not args.cuda_graph_bs or min(args.cuda_graph_bs) < 1:
            raise ValueError(f"--cuda-graph-bs needs batch sizes >= 1, got {args.cuda_graph_bs}")
