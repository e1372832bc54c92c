"""Decode speed of a mixture of experts on CPU: a random Qwen3-MoE against the dense Qwen3 of its active size.

Two random checkpoints over the bench tokenizer (vocabulary 32000) that share every shape but the
MLP: a Qwen3-MoE of ~1.0B parameters of which ~0.21B are active per token (64 experts, top-8), and
the dense Qwen3 whose ``intermediate_size`` is ``top_k * moe_intermediate_size``, so one token's
MLP reads as many weight bytes and does as many FLOPs in both. Both are built once into the
tinyserve cache (bf16, drawn per model in bf16: ~2 GB of RAM for the MoE), or into ``--out-dir``.

Each engine decodes ``--decode-steps`` tokens after a ``--prompt-len``-token prompt, at each of
``--batch-sizes``:

- tinyserve: a ``ModelRunner`` stepped directly (``bench.model_step``'s ``StepDriver``): the
  prompt prefilled once, then the decode steps timed together, median of ``--repeat`` timings;
- transformers: ``generate`` (greedy, ``min_new_tokens = max_new_tokens``, its default experts
  implementation); a logits processor stamps every step, the decode rate is the batch times the
  steps after the first over their span (the prefill left out), median of ``--hf-repeat`` calls.

The table puts them side by side: ``dense/MoE`` is the dense model's tok/s over the MoE's on
tinyserve (the goal: at most 1.5 at batch 1), ``ts/hf`` tinyserve's over transformers' on the
same model. ``--dry-run`` prints the shapes and exact parameter counts without building anything.

    python -m bench.moe_decode --dry-run
    python -m bench.moe_decode --threads 2
    python -m bench.moe_decode --threads 2 --batch-sizes 1 --hf-models moe --dtype float32
    python -m bench.moe_decode --shape tiny --out-dir /tmp/moe-tiny --prompt-len 16 --decode-steps 4
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.checkpoint import BENCH_SEED, TOKENIZER_FILES, build_bench_checkpoint, synthetic_corpus
from bench.common import default_output_path, machine_info, parse_cpu_list, pin_threads, print_table, write_json
from runtime.checkpoints.model_cache import build_once, cache_root
from runtime.checkpoints.tiny_model import train_bpe_tokenizer

logger = logging.getLogger(__name__)

# Bump when anything below changes what is built: the cache folder names include it.
MOE_BENCH_VERSION = 1
KINDS = ("moe", "dense")
GOAL_BATCH1_RATIO = 1.5  # dense tok/s over MoE tok/s at batch 1, at most


@dataclass(frozen=True)
class MoeBenchShape:
    """The MoE's shape; the dense twin takes every field but the experts'."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int  # each expert's
    vocab_size: int = 32000  # 32000: the bench tokenizer (bench.checkpoint); else one trained here
    max_positions: int = 4096
    rope_theta: float = 1000000.0
    seed: int = BENCH_SEED

    @property
    def dense_intermediate_size(self) -> int:
        """The dense twin's MLP width: a token's routed experts, side by side."""
        return self.top_k * self.moe_intermediate_size

    def folder(self, kind: str) -> str:
        return f"bench-{self.name}-{kind}-v{MOE_BENCH_VERSION}"


SHAPES: dict[str, MoeBenchShape] = {
    # bench-200m's attention and vocabulary; 64 experts of 384, top-8 (OLMoE's routing): 1.00B / 0.21B
    "moe-1b": MoeBenchShape(
        "qwen3moe-1b-a0.2b", 1024, 12, 16, 4, 64, num_experts=64, top_k=8, moe_intermediate_size=384
    ),
    # a pair of well under 1 MB for the smoke test, with a 384-token tokenizer of its own
    "tiny": MoeBenchShape(
        "qwen3moe-tiny", 64, 2, 4, 2, 16, 8, 2, 32, vocab_size=384, max_positions=512, rope_theta=10000.0
    ),
}

# ---------------------------------------------------------------------- checkpoints


def model_config(shape: MoeBenchShape, kind: str, ids: dict[str, int]) -> Any:
    """The transformers config of ``shape``'s ``kind`` ("moe": Qwen3-MoE, every layer sparse;
    "dense": Qwen3 of the MoE's active MLP width), special-token ids from ``ids``."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.dense_intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-6,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
        initializer_range=0.02,
        **{key: ids[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    if kind == "dense":
        return Qwen3Config(**common)
    if kind != "moe":
        raise ValueError(f"unknown kind {kind!r}: choose one of {', '.join(KINDS)}")
    return Qwen3MoeConfig(
        **common,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def parameter_counts(shape: MoeBenchShape) -> dict[str, int]:
    """Exact parameter counts of both models, from transformers' modules on the meta device (nothing
    allocated). ``moe_active``: what one token reads (the router, its ``top_k`` experts and all the
    rest, embedding and LM head included, as model cards count it)."""
    from transformers import AutoModelForCausalLM

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    counts: dict[str, int] = {}
    for kind in KINDS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config(shape, kind, ids))
        params = dict(model.named_parameters())
        counts[f"{kind}_total"] = sum(p.numel() for p in params.values())
        if kind == "moe":
            experts = sum(p.numel() for name, p in params.items() if ".experts." in name)
            counts["moe_experts"] = experts
            counts["moe_active"] = (
                counts["moe_total"] - experts * (shape.num_experts - shape.top_k) // shape.num_experts
            )
        counts["embedding_and_head"] = sum(
            p.numel() for name, p in params.items() if "embed" in name or "lm_head" in name
        )
    return counts


def install_tokenizer(out: Path, shape: MoeBenchShape) -> dict[str, int]:
    """The tokenizer into ``out``: the bench checkpoint's (built first when missing) for its vocabulary
    size, else one trained on the bench corpus. Returns its special-token ids."""
    if shape.vocab_size == 32000:
        source = build_bench_checkpoint()
        for name in TOKENIZER_FILES:
            shutil.copy2(source / name, out / name)
        config = json.loads((source / "config.json").read_text())
        return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    corpus = synthetic_corpus(num_lines=4 * shape.vocab_size, lexicon_size=shape.vocab_size, seed=shape.seed)
    info = train_bpe_tokenizer(shape.vocab_size, out, model_max_length=shape.max_positions, corpus=corpus)
    if info["vocab_size"] != shape.vocab_size:
        raise RuntimeError(f"the tokenizer reached {info['vocab_size']} tokens, the shape wants {shape.vocab_size}")
    return info


def build_into(out: Path, shape: MoeBenchShape, kind: str) -> Path:
    """Tokenizer and bf16 weights of ``shape``'s ``kind`` into ``out`` (transformers' init under the
    shape's seed, drawn in bf16: a fp32 draw of the MoE would take twice the memory)."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(shape, kind, install_tokenizer(out, shape))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4GB")
    logger.info("built the %s checkpoint %s in %.1f s", kind, out.name, time.perf_counter() - t0)
    return out


def build_pair(shape: MoeBenchShape, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Both checkpoints' folders (``<out_dir or the tinyserve cache>/<shape.folder(kind)>``), each built
    on first use, atomically (``build_once``)."""
    root = Path(out_dir) if out_dir is not None else cache_root()
    return {
        kind: build_once(
            root / shape.folder(kind), functools.partial(build_into, shape=shape, kind=kind), f"the {kind} model"
        )
        for kind in KINDS
    }


# ---------------------------------------------------------------------- measuring


def _rate(batch: int, per_step_s: Sequence[float]) -> dict[str, float]:
    med = statistics.median(per_step_s)
    return {"tok_s": batch / med, "step_ms": med * 1e3, "step_min_ms": min(per_step_s) * 1e3}


def tinyserve_decode(path: Path, args: argparse.Namespace, clock: Callable[[], float]) -> dict[int, dict[str, float]]:
    """Per batch size: tinyserve's decode rate on ``path`` (one ModelRunner, its KV pool sized for the largest)."""
    from bench.model_step import StepDriver, run_batches, scenario_batches, time_calls
    from runtime.engine.model_runner import ModelRunner

    biggest, context = max(args.batch_sizes), args.prompt_len + 1
    t0 = time.perf_counter()
    runner = ModelRunner(
        path,
        device="cpu",
        dtype=args.dtype,
        max_total_tokens=biggest * (context + args.decode_steps) + 16,
        max_running_requests=2 * biggest + 2,
        load_progress=False,
    )
    logger.info("tinyserve loaded %s in %.1f s", path.name, time.perf_counter() - t0)
    driver = StepDriver(runner)
    run: Callable[..., None] = functools.partial(run_batches, runner)  # (time_calls hands it the batches)
    out: dict[int, dict[str, float]] = {}
    for batch in args.batch_sizes:
        step_args = argparse.Namespace(batch=batch, context=context, decode_steps=args.decode_steps)
        make, _, _ = scenario_batches(driver, "decode", step_args)  # the prompt prefilled here, untimed
        times = time_calls(run, args.repeat, setup=make, clock=clock)
        out[batch] = _rate(batch, [t / args.decode_steps for t in times])
        logger.info("tinyserve %s batch %d: %.1f tok/s", path.name, batch, out[batch]["tok_s"])
    driver.reset()
    return out  # (the runner goes with this frame; main collects it before the next model loads)


class StepClock:
    """A logits processor that changes nothing and notes when each generated token's logits arrive."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(self.clock())
        return scores


def hf_decode(
    path: Path, args: argparse.Namespace, clock: Callable[[], float]
) -> tuple[dict[int, dict[str, float]], str | None]:
    """Per batch size: transformers ``generate``'s decode rate on ``path`` (the prefill left out); and
    the experts implementation it ran (None for a dense model)."""
    from transformers import LogitsProcessorList

    from bench.hf_baseline import HFRunner

    hf = HFRunner(str(path), "cpu", args.dtype)
    gen = torch.Generator().manual_seed(0)
    out: dict[int, dict[str, float]] = {}

    def generate(prompt: torch.Tensor, new_tokens: int, stamps: StepClock | None = None) -> None:
        with torch.inference_mode():
            hf.model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=hf.pad_id,
                eos_token_id=hf.eos_id,
                logits_processor=LogitsProcessorList([stamps] if stamps is not None else []),
            )

    for batch in args.batch_sizes:
        prompt = torch.randint(6, hf.model.config.vocab_size, (batch, args.prompt_len), generator=gen)
        generate(prompt[:, : min(8, args.prompt_len)], 3)  # warm-up: the decode shapes of this batch
        per_step: list[float] = []
        for _ in range(args.hf_repeat):
            stamps = StepClock(clock)
            generate(prompt, args.decode_steps, stamps)
            if len(stamps.stamps) != args.decode_steps:
                raise RuntimeError(f"generate ran {len(stamps.stamps)} steps, not {args.decode_steps}")
            per_step.append((stamps.stamps[-1] - stamps.stamps[0]) / (args.decode_steps - 1))
        out[batch] = _rate(batch, per_step)
        logger.info("transformers %s batch %d: %.1f tok/s", path.name, batch, out[batch]["tok_s"])
    config = hf.model.config
    experts = getattr(config, "_experts_implementation", None) if hasattr(config, "moe_intermediate_size") else None
    return out, experts


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def table_rows(
    results: dict[str, dict[str, dict[int, dict[str, float]]]], batches: Sequence[int]
) -> list[dict[str, Any]]:
    """One row per batch size: every engine's tok/s on both models and the ratios (pure)."""

    def tok_s(engine: str, kind: str, batch: int) -> float | None:
        value = results.get(engine, {}).get(kind, {}).get(batch, {}).get("tok_s")
        return float(value) if value is not None else None

    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        for engine in ("tinyserve", "hf"):
            for kind in KINDS:
                row[f"{engine}_{kind}"] = tok_s(engine, kind, b)
        row["dense_over_moe"] = _ratio(row["tinyserve_dense"], row["tinyserve_moe"])
        row["hf_dense_over_moe"] = _ratio(row["hf_dense"], row["hf_moe"])
        row["ts_over_hf_moe"] = _ratio(row["tinyserve_moe"], row["hf_moe"])
        row["ts_over_hf_dense"] = _ratio(row["tinyserve_dense"], row["hf_dense"])
        rows.append(row)
    return rows


TABLE_COLUMNS = [
    ("batch", "batch"),
    ("tinyserve_moe", "ts MoE tok/s"),
    ("tinyserve_dense", "ts dense tok/s"),
    ("dense_over_moe", "dense/MoE"),
    ("hf_moe", "hf MoE tok/s"),
    ("hf_dense", "hf dense tok/s"),
    ("hf_dense_over_moe", "hf dense/MoE"),
    ("ts_over_hf_moe", "ts/hf MoE"),
    ("ts_over_hf_dense", "ts/hf dense"),
]


def shape_rows(shape: MoeBenchShape, counts: dict[str, int]) -> list[dict[str, Any]]:
    """The two models' shapes and parameter counts, as table rows (pure)."""
    common = {
        "hidden": shape.hidden_size,
        "layers": shape.num_layers,
        "heads": f"{shape.num_heads}/{shape.num_kv_heads}",
    }
    return [
        {
            "model": "moe",
            **common,
            "mlp": f"{shape.num_experts} x {shape.moe_intermediate_size}, top-{shape.top_k}",
            "total": counts["moe_total"],
            "active": counts["moe_active"],
        },
        {
            "model": "dense",
            **common,
            "mlp": str(shape.dense_intermediate_size),
            "total": counts["dense_total"],
            "active": counts["dense_total"],
        },
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shape", choices=list(SHAPES), default="moe-1b")
    parser.add_argument("--out-dir", default=None, help="folder of the two checkpoints (default: the tinyserve cache)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32, help="tokens decoded per timing (at least 2)")
    parser.add_argument("--repeat", type=int, default=5, help="tinyserve timings per batch size")
    parser.add_argument("--hf-repeat", type=int, default=3, help="transformers generate calls per batch size")
    parser.add_argument(
        "--hf-models", nargs="*", choices=KINDS, default=list(KINDS), help="models transformers runs (none: skip it)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpus", default=None, help="cpu list to pin to, taskset syntax (default: the current set)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time (meaningful with --threads 1)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the shapes and parameter counts only")
    parser.add_argument(
        "--output", default=None, help="JSON path (default bench/results/moe_decode_<shape>_<time>.json)"
    )
    args = parser.parse_args(argv)
    if args.decode_steps < 2 or args.prompt_len < 1 or min(args.batch_sizes) < 1:
        parser.error("--decode-steps must be at least 2, --prompt-len and --batch-sizes at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    shape = SHAPES[args.shape]
    counts = parameter_counts(shape)
    shape_table = shape_rows(shape, counts)
    shape_columns = [(k, k) for k in ("model", "hidden", "layers", "heads", "mlp", "total", "active")]
    if args.dry_run:
        print_table(shape_table, shape_columns, title=f"{args.shape}: parameters (embedding and LM head included)")
        return 0
    logger.info("MoE %.3fB total / %.3fB active", counts["moe_total"] / 1e9, counts["moe_active"] / 1e9)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    paths = build_pair(shape, args.out_dir)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {"tinyserve": {}, "hf": {}}
    for kind in KINDS:
        results["tinyserve"][kind] = tinyserve_decode(paths[kind], args, clock)
        gc.collect()  # one model in memory at a time
    hf_experts: str | None = None
    for kind in args.hf_models:
        results["hf"][kind], experts = hf_decode(paths[kind], args, clock)
        hf_experts = experts or hf_experts
        gc.collect()
    rows = table_rows(results, args.batch_sizes)
    batch1 = next((r["dense_over_moe"] for r in rows if r["batch"] == 1), None)
    goal = {"batch1_dense_over_moe": batch1, "limit": GOAL_BATCH1_RATIO}
    goal["met"] = batch1 is not None and batch1 <= GOAL_BATCH1_RATIO
    print_table(shape_table, shape_columns, title=f"{args.shape}: parameters (embedding and LM head included)")
    print_table(
        rows,
        TABLE_COLUMNS,
        title=f"decode tok/s, {args.dtype}, {pinning.num_threads} threads, prompt {args.prompt_len}, "
        f"{args.decode_steps} steps ({args.clock} clock; goal dense/MoE <= {GOAL_BATCH1_RATIO} at batch 1: "
        f"{'met' if goal['met'] else 'not met'})",
    )
    record = {
        "kind": "moe_decode",
        "shape": {"name": args.shape, **asdict(shape), "dense_intermediate_size": shape.dense_intermediate_size},
        "params": counts,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "dry_run")},
        "hf_experts_implementation": hf_experts,
        "paths": {kind: str(p) for kind, p in paths.items()},
        "machine": machine_info(pinning),
        "results": {eng: {k: {str(b): v for b, v in r.items()} for k, r in by.items()} for eng, by in results.items()},
        "rows": rows,
        "goal": goal,
    }
    out = write_json(args.output or default_output_path("moe_decode", f"{args.shape}-{args.dtype}"), record)
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
