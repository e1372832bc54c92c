"""What a quantized KV cache costs in quality: greedy agreement and logprob drift of each
``--kv-cache-dtype`` against the unquantized cache of the same model and dtype, teacher-forced.

For each model and model dtype, the unquantized cache (``auto``: the model's dtype) generates
greedily from fixed prompts (``PROMPTS``: a long text to continue, chats about it, and chats asking
for a long answer: contexts of ~1-1.5k tokens, so that most of what attention reads is cached).
That exact token sequence is then fed through a runner with each quantized cache, one decode step a
token (teacher forcing: every step reads the prompt and all earlier tokens from the quantized cache),
and each step's prediction is compared with the baseline's:

- ``agree``: share of positions whose argmax equals the baseline's token (how often greedy
  decoding would pick the same token, given the same context);
- ``mean |dlp|`` / ``max |dlp|``: the absolute difference of the logprob of the baseline's token;
- ``first divergence``: each prompt generated freely (greedy) with the quantized cache, the first
  position whose token differs from the baseline's (``-``: none within the baseline's length).

Positions are the decode steps only (a prompt's prefill attends to its own fresh K/V, not the cache,
so the first new token is the same by construction), up to and including the baseline's first EOS
(else ``--max-new-tokens``). Every run steps the same sequences at every step, so the batch shapes
(and any numerics that depend on them) are the baseline's. Under an fp32 model the ``bf16`` cache is
measured too, as a yardstick: the drift a bf16 cache already causes. A quantized cache is read through
the torch gather path or the C kernels, whichever the backend has: the figures are the formats' (the
kernels dequantize to the same values), not the kernels' speed. Each model and dtype's rows are
printed to stderr as they come (SmolLM2-135M in fp32 takes ~20 min on one busy core).

    python -m bench.kv_cache_quality --device cpu --cpus 0-1
    python -m bench.kv_cache_quality --models smollm2-135m-instruct --dtypes float32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import (
    default_output_path,
    format_table,
    machine_info,
    parse_cpu_list,
    pin_threads,
    print_table,
    write_json,
)
from bench.quant_quality import TEXT as BREAD_RIVERS_COMPUTERS
from bench.sequence_driver import SequenceDriver, slots_needed

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")
MODELS = ("smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct")

MORE_TEXT = (
    "\n\nA honeybee colony works as a single organism. The queen lays the eggs, thousands of them a day in "
    "early summer, while the workers, all of them female, share every other task according to their age. "
    "The youngest clean the cells and feed the larvae; older bees build comb from wax that they make in "
    "their own bodies, guard the entrance, and finally fly out to collect nectar and pollen. A forager "
    "that finds a rich patch of flowers returns to the hive and dances on the comb: the angle of her run "
    "tells the others the direction of the flowers relative to the sun, and its length tells the distance. "
    "In autumn the colony shrinks, and through the winter the bees cluster together, shivering their "
    "flight muscles to keep the centre of the cluster warm while they live on the honey they stored.\n\n"
    "Railways changed how people thought about time. Before trains, every town kept its own local time, "
    "set by the sun at noon, so that clocks a hundred miles apart could differ by several minutes. That did "
    "not matter while a journey took days, but a timetable that listed departures in a dozen local times "
    "was a source of endless confusion and, worse, of accidents on single-track lines. Railway companies "
    "began to run their trains on the time of one city, and over the following decades whole countries "
    "adopted standard time zones, each an hour apart. The telegraph, laid along the same tracks, carried "
    "the time signal from the observatory to every station.\n\n"
    "The tides are caused mainly by the moon. Its gravity pulls slightly harder on the side of the earth "
    "that faces it than on the centre of the earth, and slightly less on the far side, so the oceans bulge "
    "on both sides at once. As the earth turns, most coasts pass through two high tides and two low tides "
    "a day. The sun adds a smaller pull of its own: when sun and moon line up, at new and full moon, their "
    "effects add and the tides are strongest; when they pull at right angles, the tides are weakest. The "
    "shape of a coast can amplify the effect greatly, and in some narrow bays the water rises and falls by "
    "more than ten metres."
)
LONG_TEXT = BREAD_RIVERS_COMPUTERS + MORE_TEXT
"""Plain expository prose written for this benchmark (~1,000 tokens): reproducible without a data set."""


@dataclass(frozen=True)
class Prompt:
    """One fixed prompt: ``text`` continued as it is, or ``chat`` (user turns and the model's replies,
    alternating, the last one a user's) rendered by the model's chat template."""

    name: str
    text: str | None = None
    chat: tuple[str, ...] = ()


PROMPTS = (
    Prompt("text", text=LONG_TEXT),
    Prompt("summary", chat=(f"Here is a text:\n\n{LONG_TEXT}\n\nSummarize each of its topics in a short paragraph.",)),
    Prompt(
        "questions",
        chat=(
            f"{LONG_TEXT}\n\nUsing only the text above, answer in detail: why do farmers settle on river plains, "
            "why do processors keep caches, how does a forager bee tell the others where flowers are, and why "
            "are tides strongest at new and full moon?",
        ),
    ),
    Prompt(
        "story",
        chat=(
            "Write a long story, at least six paragraphs, about a lighthouse keeper who finds a "
            "message in a bottle and sets out to answer it.",
        ),
    ),
    Prompt(
        "code",
        chat=(
            "Write a Python program that reads a CSV file of sales (columns: date, product, amount), prints the "
            "total amount per product and per month sorted from largest to smallest, and handles malformed rows. "
            "Explain each part of the program after the code.",
        ),
    ),
    Prompt(
        "multi-turn",
        chat=(
            "I am planning a week-long trip by train through three cities. What should I think about first?",
            "Start with the route and the dates: which cities, in what order, and how long in each. Then check "
            "train times and prices, book the long legs early, and leave a free half day in case of delays.",
            "Good. I will visit a city by the sea, a mountain town and a capital. How should I pack for all three?",
            "Pack in layers: light clothes for the coast, a warm jacket and good shoes for the mountains, and "
            "one smarter outfit for the capital. Keep the bag small enough to carry on and off trains.",
            "Now write me a detailed day-by-day plan for the whole week, with what to see and eat in each place "
            "and how to travel between them.",
        ),
    ),
)


# ---------------------------------------------------------------------- prompts


def render(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The prompt's token ids: a text as the tokenizer encodes it (with its BOS, if it adds one), a
    chat through the model's chat template, or, for a model without one (Gemma 3 270M's GGUF file has
    none), as plain ``User:`` / ``Assistant:`` turns."""
    if prompt.text is not None:
        return list(tokenizer.encode(prompt.text))
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": content} for i, content in enumerate(prompt.chat)]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
    return list(tokenizer.encode(turns + "Assistant:"))


# ---------------------------------------------------------------------- runs


@dataclass
class Run:
    """One pass of the sequences through one cache: per sequence, each decode step's argmax and the
    logprob it gives the reference token (the baseline's; in the baseline run, its own argmax)."""

    argmax: list[list[int]]
    ref_logprob: list[list[float]]


def generate(
    driver: SequenceDriver, steps: Sequence[int], eos: Sequence[int]
) -> tuple[list[list[int]], list[int], Run]:
    """The baseline: greedy from each prompt. ``steps[i]`` is the most tokens sequence ``i`` makes;
    it stops after its first EOS. Returns the tokens (prefill's first, then one per decode step),
    the measured length of each (its tokens up to and including the first EOS) and the run."""
    first = driver.prefill().argmax(dim=-1).tolist()
    tokens = [[t] for t in first]
    lengths = [1 if t in eos else n for t, n in zip(first, steps)]
    run = Run([[] for _ in first], [[] for _ in first])
    for j in range(1, max(lengths)):
        which = [i for i, n in enumerate(lengths) if j < n]
        out = driver.decode([tokens[i][-1] for i in which], which)
        logprobs = torch.log_softmax(out.logits.float(), dim=-1)
        best = logprobs.argmax(dim=-1).tolist()
        for row, i in enumerate(which):
            tokens[i].append(best[row])
            run.argmax[i].append(best[row])
            run.ref_logprob[i].append(float(logprobs[row, best[row]]))
            if best[row] in eos:
                lengths[i] = j + 1
    return tokens, lengths, run


def teacher_forced(driver: SequenceDriver, tokens: Sequence[Sequence[int]]) -> Run:
    """``tokens`` (the baseline's, each sequence's measured length) fed through ``driver``'s cache one
    decode step a token, stepping exactly the sequences the baseline stepped."""
    driver.prefill()
    lengths = [len(t) for t in tokens]
    run = Run([[] for _ in tokens], [[] for _ in tokens])
    for j in range(1, max(lengths)):
        which = [i for i, n in enumerate(lengths) if j < n]
        out = driver.decode([tokens[i][j - 1] for i in which], which)
        logprobs = torch.log_softmax(out.logits.float(), dim=-1)
        best = logprobs.argmax(dim=-1).tolist()
        for row, i in enumerate(which):
            run.argmax[i].append(best[row])
            run.ref_logprob[i].append(float(logprobs[row, tokens[i][j]]))
    return run


def free_greedy(driver: SequenceDriver, reference: Sequence[Sequence[int]]) -> list[list[int]]:
    """Greedy from each prompt through ``driver``'s cache, each sequence to the length of its
    ``reference`` (the baseline's tokens: the same sequences stepped at every step as in the baseline,
    whatever tokens come out), or until every sequence has left its reference (nothing more to learn)."""
    lengths = [len(r) for r in reference]
    tokens = [[t] for t in driver.prefill().argmax(dim=-1).tolist()]
    for j in range(1, max(lengths)):
        if all(first_divergence(ref, own) is not None for ref, own in zip(reference, tokens)):
            break
        which = [i for i, n in enumerate(lengths) if j < n]
        out = driver.decode([tokens[i][-1] for i in which], which)
        best = out.logits.argmax(dim=-1).tolist()  # (as the other runs pick: the fp32 logits' argmax)
        for row, i in enumerate(which):
            tokens[i].append(best[row])
    return tokens


def first_divergence(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """The first position where ``tokens`` differs from ``reference`` (None: equal all along)."""
    return next((j for j, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)


def score(
    reference: Sequence[Sequence[int]], baseline: Run, forced: Run, free: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """The figures of one quantized cache against the baseline. ``reference``: the baseline's tokens
    (measured lengths); ``baseline``/``forced``: the decode steps' runs (position ``j`` of a sequence is
    its step ``j - 1``); ``free``: the quantized cache's own greedy tokens. Pure."""
    agree = [int(a == t) for run_i, ref in zip(forced.argmax, reference) for a, t in zip(run_i, ref[1:])]
    drift = [
        abs(q - b)
        for base_i, forced_i in zip(baseline.ref_logprob, forced.ref_logprob)
        for b, q in zip(base_i, forced_i)
    ]
    diverged = [first_divergence(ref, own) for ref, own in zip(reference, free)]
    return {
        "positions": len(agree),
        "agree": sum(agree) / len(agree) if agree else math.nan,
        "mean_drift": sum(drift) / len(drift) if drift else math.nan,
        "max_drift": max(drift) if drift else math.nan,
        "first_divergence": diverged,
        "diverged": sum(d is not None for d in diverged),
    }


def measure(
    make_runner: Callable[[str, int], Any],
    prompts: Sequence[Sequence[int]],
    kv_dtypes: Sequence[str],
    max_new_tokens: int,
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """One model at one dtype: the baseline (``make_runner("auto", tokens)``: a runner whose pool holds
    ``tokens``; it stops a sequence at one of the runner's EOS ids), then each of ``kv_dtypes``
    against it. Returns a row per KV dtype and the baseline's tokens."""
    capacity = slots_needed([len(p) for p in prompts], max_new_tokens)
    runner = make_runner("auto", capacity)
    with SequenceDriver(runner, prompts) as driver:
        reference, lengths, baseline = generate(driver, [max_new_tokens] * len(prompts), runner.eos_token_ids)
    reference = [t[:n] for t, n in zip(reference, lengths)]
    rows = []
    for kv in kv_dtypes:
        t0 = time.perf_counter()
        runner = driver = None
        release_runners()
        runner = make_runner(kv, capacity)
        with SequenceDriver(runner, prompts) as driver:
            forced = teacher_forced(driver, reference)
        with SequenceDriver(runner, prompts) as driver:
            free = free_greedy(driver, reference)
        rows.append(
            {
                "kv_cache_dtype": kv,
                "kv_bytes_per_token": runner.token_to_kv_pool.bytes_per_token(),
                "attention_backend": runner.attention_backend_name,
                **score(reference, baseline, forced, free),
                "seconds": time.perf_counter() - t0,
            }
        )
    runner = driver = None
    release_runners()
    return rows, reference


def release_runners() -> None:
    """Free the runners no longer referenced. A runner and its attention backend refer to each other,
    so only the cycle collector frees one, and it runs by object counts, not bytes: without this a
    run of several models and dtypes kept every runner's weights and pool (the OOM killer stopped
    one at 14 GiB)."""
    gc.collect()


# ---------------------------------------------------------------------- CLI


def kv_dtypes_for(dtype: str, quantized: Sequence[str]) -> list[str]:
    """What is compared with the ``auto`` cache: the quantized formats, and under an fp32 model the
    bf16 cache first (the yardstick: what an unquantized but narrower cache already changes)."""
    return (["bf16"] if dtype == "float32" else []) + list(quantized)


def divergence_text(first: Sequence[int | None]) -> str:
    return ", ".join("-" if d is None else str(d) for d in first)


COLUMNS = [
    ("model", "model"),
    ("dtype", "dtype"),
    ("kv_cache_dtype", "KV cache"),
    ("kv_bytes_per_token", "bytes/token"),
    ("attention_backend", "attention"),
    ("positions", "positions"),
    ("agree_pct", "greedy agree %"),
    ("mean_drift", "mean |dlp|"),
    ("max_drift", "max |dlp|"),
    ("divergence", "first divergence per prompt (free greedy)"),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help="model names, GGUF files or checkpoint folders")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=QUANTIZED, default=list(QUANTIZED))
    p.add_argument("--max-new-tokens", type=int, default=256, help="the baseline's longest continuation (256)")
    p.add_argument("--prompts", nargs="+", choices=[q.name for q in PROMPTS], default=[q.name for q in PROMPTS])
    p.add_argument("--device", default="cpu", help="cpu (the only device whose kernels read a quantized cache yet)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpus", type=str, default=None, help="restrict to these cpus, taskset syntax: 0-1")
    p.add_argument("--output", default=None, help="JSON path (default bench/results/kv_cache_quality_<time>.json)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be >= 2 (the first token comes from the prefill)")
    return args


def save(
    args: argparse.Namespace, pinning: Any, chosen: Sequence[Prompt], results: list[Any], skipped: list[str]
) -> Path:
    """The JSON of everything measured so far (rewritten after each model and dtype)."""
    if args.output is None:
        args.output = str(default_output_path("kv_cache_quality", "-".join(args.dtypes)))
    return write_json(
        args.output,
        {
            "kind": "kv_cache_quality",
            "machine": machine_info(pinning),
            "settings": vars(args),
            "prompts": [q.name for q in chosen],
            "results": results,
            "skipped": skipped,
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    from runtime.checkpoints.model_source import ModelSourceError, checkpoint_folder
    from runtime.engine.model_runner import ModelRunner
    from runtime.text.tokenizer import load_tokenizer

    chosen = [q for q in PROMPTS if q.name in args.prompts]
    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    for model in args.models:
        try:
            folder = checkpoint_folder(model)
        except ModelSourceError as exc:
            skipped.append(f"{model}: {exc}")
            print(f"skipped {model}: {exc}", file=sys.stderr)
            continue
        tokenizer = load_tokenizer(str(folder))
        prompts = [render(tokenizer, q) for q in chosen]
        for dtype in args.dtypes:

            def make_runner(kv: str, tokens: int, dtype: str = dtype) -> Any:
                return ModelRunner(
                    str(folder),
                    device=args.device,
                    dtype=dtype,
                    attention_backend=args.attention_backend,
                    max_total_tokens=tokens,
                    max_running_requests=len(prompts) + 1,
                    kv_cache_dtype=kv,
                    disable_hybrid_swa_memory=True,  # (one full pool: the driver hands out plain slots)
                    load_progress=False,
                )

            t0 = time.perf_counter()
            kv_dtypes = kv_dtypes_for(dtype, args.kv_cache_dtypes)
            found, reference = measure(make_runner, prompts, kv_dtypes, args.max_new_tokens)
            contexts = [len(p) + len(r) for p, r in zip(prompts, reference)]
            for row in found:
                rows.append(
                    {
                        "model": model,
                        "dtype": dtype,
                        **row,
                        "agree_pct": 100 * row["agree"],
                        "divergence": divergence_text(row["first_divergence"]),
                    }
                )
            results.append(
                {
                    "model": model,
                    "dtype": dtype,
                    "prompt_tokens": [len(p) for p in prompts],
                    "generated_tokens": [len(r) for r in reference],
                    "contexts": contexts,
                    "rows": found,
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(
                f"{model} {dtype}: prompts {[len(p) for p in prompts]} tokens, baseline continuations "
                f"{[len(r) for r in reference]}, contexts up to {max(contexts)}; {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
            )
            save(args, pinning, chosen, results, skipped)  # (a long run's figures kept as they come)
            print(format_table(rows[-len(found) :], COLUMNS, digits=4), file=sys.stderr, flush=True)
    print_table(
        rows,
        COLUMNS,
        title=f"quantized KV cache vs the model dtype's cache, teacher-forced over the baseline's greedy continuations "
        f"of {len(chosen)} prompts ({', '.join(q.name for q in chosen)}; up to {args.max_new_tokens} new tokens); "
        "dlp: logprob of the baseline's token",
        digits=4,
    )
    for note in skipped:
        print(f"skipped: {note}")
    out = save(args, pinning, chosen, results, skipped)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
