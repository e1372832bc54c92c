"""The benchmark checkpoint: a ~200M-parameter random Llama with a 32000-token BPE tokenizer.

Benchmarks need a model big enough that the matmuls, not Python, dominate, and it
must be buildable offline and identical on every machine so results are
comparable. Weights are random under a fixed seed (``runtime.tiny_model``'s
builders do the saving); the tokenizer is trained on a synthetic corpus of
pseudo-words that is large and varied enough for 32000 BPE merges.

    python -m bench.checkpoint            # builds (once) and prints the folder
    python -m bench.checkpoint --out-dir /tmp/bench-model

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

from runtime.tiny_model import SPECIAL_TOKENS, build_checkpoint, build_once, cache_root, train_bpe_tokenizer

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
    corpus_lines: int = 120_000
    lexicon_size: int = 60_000
    seed: int = BENCH_SEED

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


BENCH_SPEC = BenchModelSpec()

# ---------------------------------------------------------------------- corpus

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "cl", "dr", "fl", "gr", "kr", "pl", "pr", "sh", "sl", "st", "str", "th", "tr", "ch", "qu")
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
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer_info["bos_token_id"],
        eos_token_id=tokenizer_info["eos_token_id"],
        pad_token_id=tokenizer_info["pad_token_id"],
        initializer_range=0.02,
    )


def build_into(out: Path, spec: BenchModelSpec) -> Path:
    """Build tokenizer + bf16 weights of ``spec`` into ``out`` (no caching)."""
    t0 = time.perf_counter()
    corpus = synthetic_corpus(spec.corpus_lines, spec.lexicon_size, spec.seed)
    info = train_bpe_tokenizer(vocab_size=spec.vocab_size, out_dir=out, model_max_length=spec.max_positions,
                               corpus=corpus)
    if info["vocab_size"] != spec.vocab_size:
        raise RuntimeError(f"the tokenizer reached only {info['vocab_size']} tokens of {spec.vocab_size}; "
                           "the corpus is too small (raise corpus_lines / lexicon_size)")
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


def special_token_ids() -> range:
    """Ids of the special tokens (pad, bos, eos, roles): the first ones in every tokenizer built here."""
    return range(len(SPECIAL_TOKENS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=str, default=None,
                        help="build here instead of the tinyserve cache folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    print(build_bench_checkpoint(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
