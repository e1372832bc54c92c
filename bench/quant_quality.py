"""What keeping the weights quantized costs in quality: perplexity of a fixed text, and greedy
agreement, for the dense weights and each ``--quantization`` method, on one model.

Each configuration loads a ``ModelRunner`` (fp32 activations, the CPU) and runs the whole text as
one prefill, then again as extends of ``--chunk`` tokens (4: the few-row kernels of a decode step,
whose quantized linears round the activations to int8 where asked: ``gguf_a8``, ``int8``), asking for every position's logprob
(SGLang's input logprobs); perplexity is
``exp(-mean logprob)`` over the text's tokens after the first. ``top1`` is the share of positions
whose most likely next token equals the dense model's (how often greedy decoding would agree,
token for token, given the same context). The text is a few paragraphs of plain expository English
written for this benchmark (``TEXT``), so the figure is reproducible without a dataset.

    .venv/bin/python -m bench.quant_quality                     # the default model: dense, gguf, gguf_a8, int8
    .venv/bin/python -m bench.quant_quality --methods none int8 --model-path DIR
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import pin_threads, print_table  # noqa: E402

TEXT = (
    "Bread is one of the oldest prepared foods. A simple loaf needs only flour, water, salt and yeast. "
    "The baker mixes the flour with water until a rough dough forms, then adds the salt and the yeast. "
    "Kneading stretches the gluten in the flour into long elastic strands, which trap the gas that the "
    "yeast releases as it feeds on the sugars in the dough. After an hour or two in a warm place the "
    "dough has doubled in size. The baker then shapes it into a loaf, lets it rise a second time, and "
    "bakes it in a hot oven until the crust is brown and the loaf sounds hollow when tapped.\n\n"
    "Rivers shape the land they cross. Over thousands of years, running water carries sand and stones "
    "downstream, cutting valleys into hills and building wide plains where the current slows. Near the "
    "sea, a river often splits into many smaller channels and leaves its sediment behind, forming a "
    "delta. Farmers have settled on these plains since ancient times, because the soil is rich and "
    "water is close at hand, although floods remain a constant risk.\n\n"
    "A computer stores everything as numbers. Text is a sequence of codes, one for each character; a "
    "picture is a grid of small dots, each described by how much red, green and blue light it holds. "
    "The processor reads these numbers from memory, combines them according to the instructions of a "
    "program, and writes the results back. Because memory is much slower than the processor, modern "
    "chips keep small, fast caches of recently used data close to their arithmetic units."
)
# gguf: the blocks multiplied weight-only (the default); gguf_a8: the same blocks with
# --quantized-activations int8 (llama.cpp's numerics); int8: w8a8 of the dense values
METHODS = ("none", "gguf", "gguf_a8", "int8")


def text_logprobs(runner: Any, ids: list[int], chunk: int | None = None) -> tuple[Any, Any]:
    """``(logprob of each token after the first, argmax next token at each position)`` of the text
    run as one prefill, or as extends of ``chunk`` tokens after the cached rest (a forward of a few
    rows takes the kernels a decode step of a few requests takes)."""
    import torch

    from runtime.engine.forward_batch import ForwardMode, InputLogprobRows
    from tests.support.harness import Harness

    harness = Harness(runner)
    req = harness.add_request(ids)
    n = len(ids)
    logprobs, top1 = [], []
    start = 0
    while start < n:
        batch, (count,) = harness.build_batch([req], ForwardMode.EXTEND, max_new=chunk)
        rows = torch.arange(count, dtype=torch.int64)
        targets = ids[start + 1 : start + count + 1]
        batch.input_logprobs = InputLogprobRows(
            logit_rows=rows,
            sample_rows=rows[-1:],
            prompt_rows=rows[: len(targets)],
            target_ids=torch.tensor(targets, dtype=torch.int64),
        )
        out = runner.forward(batch, top_logprobs_num=1)
        assert out.input_token_logprobs is not None and out.input_top_logprobs is not None
        logprobs.append(out.input_token_logprobs)
        top1.append(out.input_top_logprobs[1][:, 0])
        start += count
    harness.reset()
    return torch.cat(logprobs), torch.cat(top1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="smollm2-135m-instruct", help="checkpoint, GGUF file or model name")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--chunk",
        type=int,
        default=4,
        help="also run the text in extends of this many tokens: the few-row kernels of a decode step "
        "(the CPU's quantized linears round activations below 24 rows, not from 24)",
    )
    args = p.parse_args(argv)
    pin_threads(args.threads)
    from runtime.engine.model_runner import ModelRunner
    from runtime.text.tokenizer import load_tokenizer

    rows: list[dict[str, Any]] = []
    reference = None
    for method in args.methods:
        t0 = time.perf_counter()
        runner = ModelRunner(
            args.model_path,
            device="cpu",
            dtype="float32",
            max_total_tokens=4096,
            load_progress=False,
            quantization=None if method == "none" else method.removesuffix("_a8"),
            int8_activations=method.endswith("_a8"),
        )
        ids = list(load_tokenizer(str(runner.model_path)).encode(TEXT))
        logprobs, top1 = text_logprobs(runner, ids)
        few_logprobs, few_top1 = text_logprobs(runner, ids, args.chunk)
        if reference is None:
            reference = top1
        rows.append(
            {
                "method": method,
                "tokens": len(ids),
                "weights_mib": runner.weight_bytes() / 2**20,
                "ppl": math.exp(-float(logprobs.mean())),
                "top1": float((top1 == reference).float().mean()),
                "ppl_few": math.exp(-float(few_logprobs.mean())),
                "top1_few": float((few_top1 == reference).float().mean()),
                "seconds": time.perf_counter() - t0,
            }
        )
    print_table(
        rows,
        [
            ("method", "--quantization"),
            ("tokens", "tokens"),
            ("weights_mib", "weights MiB"),
            ("ppl", "perplexity (one prefill)"),
            ("top1", "top-1 = first row's"),
            ("ppl_few", f"perplexity ({args.chunk}-token extends)"),
            ("top1_few", "top-1 = first row's"),
            ("seconds", "load+run s"),
        ],
        title=f"{args.model_path}: perplexity of bench.quant_quality.TEXT, fp32 activations",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
