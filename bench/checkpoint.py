"""The benchmark checkpoints: random Llamas with one 32000-token BPE tokenizer.

Benchmarks need a model big enough that the matmuls, not Python, dominate, and it
must be buildable offline and identical on every machine so results are
comparable. Weights are random under a fixed seed (``runtime.checkpoints.tiny_model``'s
builders do the saving); the tokenizer is trained on a synthetic corpus of
pseudo-words that is large and varied enough for 32000 BPE merges.

    python -m bench.checkpoint            # builds (once) and prints the folder
    python -m bench.checkpoint --out-dir /tmp/bench-model
    python -m bench.checkpoint --shape llama-8b --device cuda   # GPU-sized shapes (``SHAPES``)

The default is the ~200M model CPU benchmarks use. ``--shape llama-1b`` / ``llama-8b``
have Llama-3.2-1B's and Llama-3-8B's block shapes (hidden, layers, heads, MLP width,
RoPE theta, tied or not) with the same tokenizer as the default, so the vocabulary is
32000, not Llama-3's 128256: the served tokenizer must be able to decode every id the
LM head can produce. Their weights are drawn on ``--device`` (a GPU draws 8B parameters
in seconds; a CPU in fp32 would need 32 GB) and saved as bf16 shards; the tokenizer is
copied from the default checkpoint's folder (built first when missing).

The folder is cached under the tinyserve cache (``$TINYSERVE_CACHE``, else
``~/.cache/tinyserve``) and built atomically, so concurrent first uses are safe.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from runtime.checkpoints.model_cache import build_once, cache_root
from runtime.checkpoints.tiny_model import SPECIAL_TOKENS, build_checkpoint, train_bpe_tokenizer

logger = logging.getLogger(__name__)

# Bump when anything below changes what is built: the cache folder name includes it.
BENCH_MODEL_VERSION = 1
BENCH_SEED = 20250101


@dataclass(frozen=True)
class BenchModelSpec:
    """Shape of a benchmark checkpoint. ``BENCH_SPEC`` is the one the issue fixes."""

    name: str = f"bench-llama-200m-v{BENCH_MODEL_VERSION}"
    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 2816
    vocab_size: int = 32000
    max_positions: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    corpus_lines: int = 120_000
    lexicon_size: int = 60_000
    seed: int = BENCH_SEED

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


BENCH_SPEC = BenchModelSpec()
# GPU benchmark shapes: Llama-3.2-1B and Llama-3-8B blocks over the bench tokenizer's vocabulary.
SHAPES: dict[str, BenchModelSpec] = {
    "bench-200m": BENCH_SPEC,
    "llama-1b": BenchModelSpec(
        name=f"bench-llama-1b-v{BENCH_MODEL_VERSION}",
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        max_positions=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "llama-8b": BenchModelSpec(
        name=f"bench-llama-8b-v{BENCH_MODEL_VERSION}",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        max_positions=8192,
        rope_theta=500000.0,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# ---------------------------------------------------------------------- corpus

_ONSETS = (
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "cl",
    "dr",
    "fl",
    "gr",
    "kr",
    "pl",
    "pr",
    "sh",
    "sl",
    "st",
    "str",
    "th",
    "tr",
    "ch",
    "qu",
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oa", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x")
_PUNCT = (".", ".", ".", ",", "?", "!", ";", ":")


def _lexicon(size: int, rng: random.Random) -> list[str]:
    """``size`` distinct pseudo-words of 1-4 syllables (drawn in a fixed order)."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < size:
        n = rng.choice((1, 2, 2, 3, 3, 4))
        w = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(n))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def synthetic_corpus(num_lines: int, lexicon_size: int, seed: int) -> list[str]:
    """Deterministic text for BPE training: Zipf-distributed pseudo-words, numbers, code-ish lines.

    Why synthetic: no data can be downloaded, and a 32000-token vocabulary needs tens of
    thousands of distinct, repeated words (BPE only merges pairs seen at least twice).
    The Zipf weights make frequent words merge early, as in natural text.
    """
    rng = random.Random(seed)
    words = _lexicon(lexicon_size, rng)
    cum = list(accumulate(1.0 / (rank + 10) for rank in range(len(words))))
    lines: list[str] = []
    for i in range(num_lines):
        kind = i % 10
        n = rng.randint(6, 18)
        picked = rng.choices(words, cum_weights=cum, k=n)
        if kind == 7:
            lines.append(f"{picked[0]}_{picked[1]}({picked[2]}, {rng.randint(0, 9999)}) = {picked[3]}.{picked[4]}")
        elif kind == 9:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(n // 2)))
        else:
            first = picked[0].capitalize() if kind % 2 == 0 else picked[0]
            lines.append(" ".join([first, *picked[1:]]) + rng.choice(_PUNCT))
    return lines


# ---------------------------------------------------------------------- building


def bench_llama_config(spec: BenchModelSpec, tokenizer_info: dict[str, int]) -> Any:
    """The transformers LlamaConfig of ``spec`` (special-token ids from the tokenizer)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer_info["bos_token_id"],
        eos_token_id=tokenizer_info["eos_token_id"],
        pad_token_id=tokenizer_info["pad_token_id"],
        initializer_range=0.02,
    )


def build_into(out: Path, spec: BenchModelSpec) -> Path:
    """Build tokenizer + bf16 weights of ``spec`` into ``out`` (no caching)."""
    t0 = time.perf_counter()
    corpus = synthetic_corpus(spec.corpus_lines, spec.lexicon_size, spec.seed)
    info = train_bpe_tokenizer(
        vocab_size=spec.vocab_size, out_dir=out, model_max_length=spec.max_positions, corpus=corpus
    )
    if info["vocab_size"] != spec.vocab_size:
        raise RuntimeError(
            f"the tokenizer reached only {info['vocab_size']} tokens of {spec.vocab_size}; "
            "the corpus is too small (raise corpus_lines / lexicon_size)"
        )
    logger.info("trained a %d-token tokenizer in %.1f s", info["vocab_size"], time.perf_counter() - t0)
    build_checkpoint(bench_llama_config(spec, info), out, seed=spec.seed, dtype=torch.bfloat16)
    logger.info("built %s in %.1f s", out, time.perf_counter() - t0)
    return out


def build_bench_checkpoint(out_dir: str | Path | None = None, spec: BenchModelSpec = BENCH_SPEC) -> Path:
    """The benchmark checkpoint folder, built on first use.

    ``out_dir=None`` uses ``<tinyserve cache>/<spec.name>``. An existing folder with a
    config.json is reused as is. The build goes to a temporary sibling folder and is
    renamed into place, so a crash never leaves a half-built checkpoint behind and two
    concurrent builders both end with the same complete folder.
    """
    final = Path(out_dir) if out_dir is not None else cache_root() / spec.name
    return build_once(final, lambda tmp: build_into(tmp, spec), "the benchmark checkpoint")


def build_shaped_into(out: Path, spec: BenchModelSpec, tokenizer_dir: Path, device: str) -> Path:
    """Weights of ``spec`` drawn on ``device`` (transformers' init, seeded), saved as bf16 shards
    next to a copy of ``tokenizer_dir``'s tokenizer (its special-token ids go into the config)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tok) != spec.vocab_size:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {len(tok)} tokens, the shape wants {spec.vocab_size}")
    ids = json.loads((tokenizer_dir / "config.json").read_text()) if (tokenizer_dir / "config.json").is_file() else {}
    info = {key: ids.get(key, getattr(tok, key)) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    config = bench_llama_config(spec, info)
    on_cuda = torch.device(device).type == "cuda"
    with torch.random.fork_rng(devices=[torch.device(device).index or 0] if on_cuda else [], device_type="cuda"):
        torch.manual_seed(spec.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4GB")
    logger.info("built %s (%s, drawn on %s) in %.1f s", out, spec.name, device, time.perf_counter() - t0)
    return out


def build_shaped_checkpoint(shape: str, out_dir: str | Path | None = None, device: str = "auto") -> Path:
    """The checkpoint of ``SHAPES[shape]``, built on first use (cached like ``build_bench_checkpoint``)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
    spec = SHAPES[shape]
    if spec == BENCH_SPEC:
        return build_bench_checkpoint(out_dir)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    final = Path(out_dir) if out_dir is not None else cache_root() / spec.name
    tokenizer_dir = build_bench_checkpoint()
    return build_once(final, lambda tmp: build_shaped_into(tmp, spec, tokenizer_dir, device), f"the {shape} checkpoint")


def special_token_ids() -> range:
    """Ids of the special tokens (pad, bos, eos, roles): the first ones in every tokenizer built here."""
    return range(len(SPECIAL_TOKENS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=str, default=None, help="build here instead of the tinyserve cache folder")
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        default="bench-200m",
        help="model shape (default bench-200m, the CPU benchmarks' model)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="where llama-1b/llama-8b weights are drawn: auto (cuda when available), cuda, cpu",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    print(build_shaped_checkpoint(args.shape, args.out_dir, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
