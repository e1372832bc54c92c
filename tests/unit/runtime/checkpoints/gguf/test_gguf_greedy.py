"""A GGUF file served by our ModelRunner generates what transformers generates from the same file.

The reference is transformers' own GGUF loading (``from_pretrained(folder, gguf_file=...)``)
of the very file we serve, so both sides see the same dequantized weights: greedy tokens must
be equal and per-token log-probabilities close (the tiny random models often repeat one
token, where equal tokens alone would prove little). Covered: llama with its Q/K rows
interleaved by the converter, Qwen2 (q/k/v biases), Qwen3 (q/k norms, head_dim 32) and a
Mistral (a llama-architecture file told apart by general.name), in Q8_0 and F16, a tied
Qwen2, and a llama.cpp Q4_K_M-like mix of K-quants. What
transformers' GGUF loader ignores (linear RoPE scaling, Qwen3's explicit head_dim) is checked
against the source checkpoint instead, and TP=2 shards of a quantized file against TP=1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import TinyCheckpoints, hf_greedy, load_hf_model, random_prompt
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.support.gguf_models import gguf_runner, transformers_gguf
from tests.support.harness import Harness
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

NEW_TOKENS = 10
PROMPT_LENS = (5, 17)
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder for this module's GGUF files, and a private cache for the folders prepared from them."""
    with gguf_test_folder(tmp_path_factory, "gguf-greedy") as folder:
        yield folder


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=70 + n) for n in PROMPT_LENS]


def _assert_same_generation(runner: ModelRunner, reference: Any) -> None:
    prompts = _prompts(runner.vocab_size)
    ours = Harness(runner).generate(prompts, NEW_TOKENS, return_logprob=True)
    for prompt, req in zip(prompts, ours):
        tokens, logprobs = hf_greedy(reference, prompt, NEW_TOKENS)
        assert req.output_ids == tokens, f"prompt of length {len(prompt)}"
        assert req.logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"prompt of length {len(prompt)}"


# A llama.cpp "Q4_K_M"-like mixture on the checkpoint whose every row is 256 wide (one K-quant
# super-block): most weights Q4_K, some Q6_K / Q5_K, and the 2-3 bit types too.
KQUANT_MIX = {
    "output.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_v.weight": "Q5_K",
    "blk.1.ffn_up.weight": "Q3_K",
    "blk.0.attn_output.weight": "Q2_K",
}


@pytest.mark.parametrize(
    ("name", "weight_type", "tie", "architecture"),
    [
        ("llama", "Q8_0", False, "LlamaForCausalLM"),
        ("llama", "F16", False, "LlamaForCausalLM"),
        ("qwen2", "Q8_0", False, "Qwen2ForCausalLM"),
        ("qwen2", "Q8_0", True, "Qwen2ForCausalLM"),  # tied, as Qwen2.5-0.5B is
        ("llama_hd64", "Q4_K", False, "LlamaForCausalLM"),  # with KQUANT_MIX
    ],
)
def test_greedy_equals_transformers_gguf_loading(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str, weight_type: str, tie: bool, architecture: str
) -> None:
    path = write_checkpoint_gguf(
        tiny_checkpoints.path(name),
        files / f"{name}-{weight_type}-{tie}.gguf",
        weight_type=weight_type,
        types=KQUANT_MIX if weight_type == "Q4_K" else None,
        tie=tie,
        rope_scaling=False,
    )  # transformers reads Qwen's vocab size off the tokens
    runner = gguf_runner(path)
    assert runner.model_config.architecture == architecture
    assert runner.model_config.tie_word_embeddings is tie
    _assert_same_generation(runner, transformers_gguf(path))


def test_mistral_named_file_serves_as_mistral(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    """transformers 5 with gguf 0.19 cannot load a llama file named "mistral" (gguf-py has no
    plain "mistral" architecture), so the reference loads the same Q8_0 tensors from a copy that
    differs only in general.name: with a window longer than the context, Mistral computes what
    Llama does, and the one-KV-head GQA and Q/K un-interleave are what is under test."""
    src = tiny_checkpoints.path("mistral")
    served = write_checkpoint_gguf(src, files / "mistral-Q8_0.gguf", weight_type="Q8_0", tokenizer=False)
    as_llama = write_checkpoint_gguf(
        src, files / "mistral-as-llama-Q8_0.gguf", weight_type="Q8_0", model_name="tiny", tokenizer=False
    )
    runner = gguf_runner(served)
    assert runner.model_config.architecture == "MistralForCausalLM" and runner.model_config.num_key_value_heads == 1
    _assert_same_generation(runner, transformers_gguf(as_llama))


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_metadata_transformers_ignores_matches_the_source_checkpoint(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str
) -> None:
    """Qwen2's linear RoPE scaling (rope.scaling.*) and Qwen3's head_dim 32 != hidden / heads
    (attention.key_length) reach our model. transformers' GGUF loader drops both, so the
    reference is the source checkpoint itself: an F32 file holds its weights exactly."""
    src = tiny_checkpoints.path(name)
    runner = gguf_runner(write_checkpoint_gguf(src, files / f"{name}-source-F32.gguf", tokenizer=False))
    source_config = gguf_runner(src).model_config
    assert (runner.model_config.rope, runner.model_config.head_dim) == (source_config.rope, source_config.head_dim)
    _assert_same_generation(runner, load_hf_model(src))


# mistral: its one KV head is replicated, so each rank un-interleaves the whole K
@pytest.mark.parametrize(("name", "weight_type"), [("llama", "Q8_0"), ("mistral", "Q8_0"), ("llama_hd64", "Q4_K")])
def test_tp2_shards_of_a_quantized_llama_file_reproduce_tp1(
    tiny_checkpoints: TinyCheckpoints, files: Path, thread_tp_group: ThreadTPGroup, name: str, weight_type: str
) -> None:
    """Each rank reads its head-aligned Q/K rows (un-interleaved per head) and its columns of the
    row-parallel weights straight from the quantized file (whole Q8_0 blocks; the 128-column
    halves of 256-wide K-quant rows take the dequantize-all path)."""
    path = write_checkpoint_gguf(
        tiny_checkpoints.path(name),
        files / f"{name}-tp-{weight_type}.gguf",
        weight_type=weight_type,
        types=KQUANT_MIX if weight_type == "Q4_K" else None,
        tokenizer=False,
    )
    reference = gguf_runner(path)
    prompts = _prompts(reference.vocab_size)
    expected = [r.output_ids for r in Harness(reference).generate(prompts, NEW_TOKENS)]
    ranks = [gguf_runner(path, tp_rank=r, tp_size=2) for r in range(2)]
    assert ranks[0].num_heads == reference.num_heads // 2

    results = run_on_ranks(
        thread_tp_group, lambda rank: [r.output_ids for r in Harness(ranks[rank]).generate(prompts, NEW_TOKENS)]
    )
    assert results[0] == results[1] == expected
