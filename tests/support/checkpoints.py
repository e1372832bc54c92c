"""The one place that builds tiny test checkpoints (Llama, Mistral, Qwen2, Qwen3, tied Llama 3,
Gemma 2/3, Phi-3, the mixtures of experts Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE, the
sliding-window Mistral and hybrid Qwen2, and the encoders BERT and XLM-RoBERTa with their
sequence classifiers).

Each is a genuine HF folder made with transformers' config classes and save_pretrained
(through ``runtime.checkpoints.tiny_model.build_checkpoint``) plus a tokenizer that AutoTokenizer
loads: byte-level BPE for the decoders; for the encoders BERT's WordPiece and XLM-RoBERTa's
sentencepiece-style Unigram, trained on the same embedded corpus, both taking sentence pairs
(``tok(text, text_pair)``; BERT's gives token types). The "bert" folder is a sentence-transformers
one too (mean pooling, normalised: ``modules.json``, ``1_Pooling/config.json``). Shapes are tiny (hidden 64, 2 layers) so a whole test session stays fast on CPU.
All 1-D weights (norm scales, biases) are randomised after transformers' init, which
leaves them at 1 / 0: otherwise a loader that dropped them would go unnoticed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from runtime.checkpoints.tiny_model import build_checkpoint, train_bpe_tokenizer

CHECKPOINT_NAMES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "llama_tied_llama3",
    "gemma2",
    "gemma3",
    "phi3",
    "phi3_longrope",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "qwen2_moe",
)
# The encoders (embedding tests; not decoders, so not in CHECKPOINT_NAMES): hidden 64, 2 layers, 4
# heads, 128 positions; the classifiers score 1 label (a reranker's) and 3.
ENCODER_CHECKPOINT_NAMES: tuple[str, ...] = ("bert", "bert_classifier", "xlm_roberta", "xlm_roberta_classifier")
ENCODER_MAX_POSITIONS = 128
ENCODER_NUM_LABELS: dict[str, int] = {"bert_classifier": 1, "xlm_roberta_classifier": 3}
# the mixtures of experts among them (MoE tests: tensor and expert parallelism, the router)
MOE_CHECKPOINT_NAMES: tuple[str, ...] = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
# Sliding-window checkpoints (sliding-window tests): window of their windowed layers.
SWA_WINDOWS: dict[str, int] = {"mistral_swa": 16, "qwen2_swa": 24}
# phi3_longrope's original_max_position_embeddings: its long factors rotate the tokens of a
# sequence longer than this. The parametrized tests' sequences (prompt and output) stay within
# it: transformers' generate re-runs a sequence that outgrows it during decoding with the long
# factors (Phi3ForCausalLM.prepare_inputs_for_generation), which serving does not. Prompts
# across it, and decoding past it, are tests/unit/runtime/engine/models/test_phi3.py's.
PHI3_ORIGINAL_MAX = 96
# the multimodal checkpoint's image placeholder, begin- and end-of-image ids: text prompts stay below
GEMMA_IMAGE_TOKENS = (380, 381, 382)
GEMMA_WINDOW = 16  # the Gemma checkpoints' windowed layers (prompts of the parity tests cross it)
TOKENIZER_VOCAB = 384
MAX_POSITIONS = 512
SEED = 1234

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _common(tok: dict[str, int]) -> dict[str, Any]:
    return {
        "vocab_size": tok["vocab_size"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": 0.1,
        "bos_token_id": tok["bos_token_id"],
        "eos_token_id": tok["eos_token_id"],
        "pad_token_id": tok["pad_token_id"],
    }


def checkpoint_config(name: str, tok: dict[str, int]) -> Any:
    """The transformers config of test checkpoint ``name`` (tokenizer ids from ``tok``)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    c = _common(tok)
    if name == "llama":
        return LlamaConfig(**c, rope_theta=10000.0, tie_word_embeddings=False)
    if name == "llama_long":  # long prompts (scheduler tests); not in the parametrized set
        return LlamaConfig(**{**c, "max_position_embeddings": 4096}, rope_theta=10000.0, tie_word_embeddings=False)
    if name == "llama_hd64":  # head_dim 64, what the pair-packed prefix kernels take; not in the parametrized set
        return LlamaConfig(
            **{**c, "hidden_size": 256, "intermediate_size": 256}, rope_theta=10000.0, tie_word_embeddings=False
        )
    if name == "mistral":  # GQA group 4 (4 query heads share 1 KV head)
        return MistralConfig(**{**c, "num_key_value_heads": 1}, rope_theta=10000.0, sliding_window=4096)
    if name == "qwen2":  # q/k/v biases, linear RoPE scaling
        return Qwen2Config(
            **c,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        )
    if (
        name == "qwen2_hd64"
    ):  # rows of 256 (one K-quant super-block) with Qwen2's q/k/v biases; not in the parametrized set
        return Qwen2Config(
            **{**c, "hidden_size": 256, "intermediate_size": 256}, rope_theta=1000000.0, tie_word_embeddings=False
        )
    if name == "mistral_swa":  # every layer windowed (W = 16); not in the parametrized set
        return MistralConfig(**{**c, "num_key_value_heads": 1}, rope_theta=10000.0, sliding_window=SWA_WINDOWS[name])
    if name == "qwen2_swa":  # 4 layers: 0-1 full attention, 2-3 windowed (W = 24); not in the parametrized set
        return Qwen2Config(
            **{**c, "num_hidden_layers": 4},
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=SWA_WINDOWS[name],
            max_window_layers=2,
        )
    if name == "qwen3":  # per-head q/k RMSNorm, head_dim 32 != hidden / heads
        return Qwen3Config(**c, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
    if name == "gemma2":  # sandwich norms, gelu-tanh, scaled embeddings, both soft-caps, windowed / full layers
        return Gemma2Config(
            **c,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,  # small caps: the tiny model's scores and logits reach them
            final_logit_softcapping=3.0,
            sliding_window=GEMMA_WINDOW,
            rope_theta=10000.0,
        )
    if name == "gemma3":  # q/k norms, windowed layers with their own RoPE base, a full layer between them
        return Gemma3TextConfig(
            **{**c, "num_hidden_layers": 3},
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=GEMMA_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    if name == "gemma3_multimodal":  # the tiny gemma3 inside a Gemma3ForConditionalGeneration; not parametrized
        from transformers import Gemma3Config, SiglipVisionConfig

        vision = SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        )
        return Gemma3Config(
            text_config=checkpoint_config("gemma3", tok),
            vision_config=vision,
            mm_tokens_per_image=4,
            **dict(zip(("image_token_index", "boi_token_index", "eoi_token_index"), GEMMA_IMAGE_TOKENS)),
        )
    # what transformers' GGUF loader rebuilds from the file (its config classes' defaults); not parametrized
    if name == "gemma2_gguf":
        return Gemma2Config(**c, head_dim=256, sliding_window=GEMMA_WINDOW, rope_theta=10000.0)
    if name == "gemma3_gguf":  # likewise: five windowed layers to one full (the default pattern)
        return Gemma3TextConfig(**{**c, "num_hidden_layers": 6}, head_dim=256, sliding_window=GEMMA_WINDOW)
    if name == "phi3":  # fused qkv_proj / gate_up_proj in the checkpoint, GQA
        return Phi3Config(**c, rope_theta=10000.0, tie_word_embeddings=False)
    if name == "phi3_longrope":  # 3/4 of each head rotated, LongRoPE (short and long factors), tied
        return Phi3Config(
            **c,
            partial_rotary_factor=0.75,  # head_dim 16: 12 rotary dims, 6 pairs
            original_max_position_embeddings=PHI3_ORIGINAL_MAX,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.0, 1.1, 1.3, 1.6, 2.0],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0],
            },
            tie_word_embeddings=True,
        )
    if name == "qwen3_moe":  # 16 experts, top-4 renormalised; layer 1 of 3 dense (mlp_only_layers)
        return Qwen3MoeConfig(
            **{**c, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        )
    if name == "mixtral":  # top-2 of 8 (fp32 routing weights), every layer windowed (W = 4096)
        return MixtralConfig(
            **{**c, "num_key_value_heads": 1, "intermediate_size": 48},
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=4096,
            rope_theta=1000000.0,
        )
    if name == "olmoe":  # top-2 of 6, not renormalised; whole-projection q/k norms, q/k/v clamped
        return OlmoeConfig(
            **{**c, "intermediate_size": 32},
            num_experts=6,
            num_experts_per_tok=2,
            clip_qkv=1.5,
            rope_theta=10000.0,
        )
    if name == "qwen2_moe":  # top-2 of 8 with the gated shared expert; layer 0 dense (decoder_sparse_step 2)
        return Qwen2MoeConfig(
            **c,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            decoder_sparse_step=2,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        )
    if name == "llama_tied_llama3":
        return LlamaConfig(
            **c,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    raise ValueError(
        f"unknown test checkpoint {name!r}; known: {', '.join(CHECKPOINT_NAMES)}, llama_long, llama_hd64, qwen2_hd64, "
        f"gemma2_gguf, gemma3_gguf, {', '.join(SWA_WINDOWS)}"
    )


def _randomise_1d_weights(seed: int) -> Callable[[nn.Module], None]:
    def init(model: nn.Module) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    # a norm's scale about 1 (BERT's "LayerNorm.weight" too), its bias and others about 0
                    base = 1.0 if "norm" in pname.lower() and not pname.endswith(".bias") else 0.0
                    p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))

    return init


def encoder_config(name: str, tok: dict[str, int]) -> Any:
    """The transformers config of encoder checkpoint ``name`` (tokenizer ids from ``tok``)."""
    from transformers import BertConfig, XLMRobertaConfig

    common: dict[str, Any] = {
        "vocab_size": tok["vocab_size"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "initializer_range": 0.1,
        "pad_token_id": tok["pad_token_id"],
    }
    labels = ENCODER_NUM_LABELS.get(name)
    if labels is not None:
        common["num_labels"] = labels
    if name.startswith("bert"):
        return BertConfig(**common, max_position_embeddings=ENCODER_MAX_POSITIONS, type_vocab_size=2)
    if name.startswith("xlm_roberta"):  # positions from past the padding id: 2 more rows than tokens
        return XLMRobertaConfig(
            **common,
            max_position_embeddings=ENCODER_MAX_POSITIONS + tok["pad_token_id"] + 1,
            type_vocab_size=1,
            bos_token_id=tok["bos_token_id"],
            eos_token_id=tok["eos_token_id"],
        )
    raise ValueError(f"unknown encoder checkpoint {name!r}; known: {', '.join(ENCODER_CHECKPOINT_NAMES)}")


def _train_encoder_tokenizer(name: str, out: Path) -> dict[str, int]:
    """BERT's WordPiece (``[CLS] a [SEP] b [SEP]``, token types 0 then 1) or XLM-RoBERTa's Unigram
    (``<s> a </s></s> b </s>``, ids ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3 as its own), trained
    on the embedded corpus and saved as the folder's tokenizer."""
    from tokenizers import BertWordPieceTokenizer, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizer, XLMRobertaTokenizer

    from runtime.checkpoints.tiny_model import embedded_corpus

    corpus = embedded_corpus()
    if name.startswith("bert"):
        wordpiece = BertWordPieceTokenizer(lowercase=True)
        wordpiece.train_from_iterator(
            corpus,
            vocab_size=TOKENIZER_VOCAB,
            min_frequency=2,
            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            show_progress=False,
        )
        bert = BertTokenizer(vocab=wordpiece.get_vocab(), model_max_length=ENCODER_MAX_POSITIONS)
        bert.save_pretrained(out)
        ids = bert.convert_tokens_to_ids(["[PAD]", "[CLS]", "[SEP]"])
        size = len(bert)
    else:
        unigram = Tokenizer(models.Unigram())
        unigram.normalizer = normalizers.NFKC()
        unigram.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=TOKENIZER_VOCAB,
            special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
            unk_token="<unk>",
            show_progress=False,
        )
        unigram.train_from_iterator(corpus, trainer=trainer)
        pieces = [(str(piece), float(score)) for piece, score in json.loads(unigram.to_str())["model"]["vocab"]]
        xlmr = XLMRobertaTokenizer(vocab=[*pieces, ("<mask>", 0.0)], model_max_length=ENCODER_MAX_POSITIONS)
        xlmr.save_pretrained(out)
        ids = xlmr.convert_tokens_to_ids(["<pad>", "<s>", "</s>"])
        size = len(xlmr)
    return dict(zip(("pad_token_id", "bos_token_id", "eos_token_id"), ids)) | {"vocab_size": size}


def _write_sentence_transformers_files(out: Path) -> None:
    """sentence-transformers' module list (transformer, mean pooling, normalisation) and pooling config."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")


def build_encoder_checkpoint(name: str, out_dir: str | Path) -> Path:
    """Tokenizer + fp32 random weights of encoder checkpoint ``name`` in ``out_dir``."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_encoder_tokenizer(name, out)
    auto_class = AutoModelForSequenceClassification if name in ENCODER_NUM_LABELS else AutoModel
    build_checkpoint(
        encoder_config(name, tok), out, seed=SEED, init_fn=_randomise_1d_weights(SEED + 1), auto_class=auto_class
    )
    if name == "bert":
        _write_sentence_transformers_files(out)
    return out


def load_hf_encoder(path: str | Path) -> Any:
    """The transformers reference of an encoder checkpoint (its base model, or its sequence
    classifier), fp32, eval mode."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    auto_class = AutoModelForSequenceClassification if classifier else AutoModel
    return auto_class.from_pretrained(path, dtype=torch.float32).eval()


def build_test_checkpoint(name: str, out_dir: str | Path, max_shard_size: str | None = None) -> Path:
    """Tokenizer + fp32 random weights of checkpoint ``name`` in ``out_dir``."""
    if name in ENCODER_CHECKPOINT_NAMES:
        return build_encoder_checkpoint(name, out_dir)
    out = Path(out_dir)
    qwen = name.startswith("qwen")
    tok = train_bpe_tokenizer(TOKENIZER_VOCAB, out, qwen_split=qwen, add_bos=not qwen, model_max_length=MAX_POSITIONS)
    config = checkpoint_config(name, tok)
    build_checkpoint(
        config,
        out,
        seed=SEED,
        dtype=torch.float32,
        max_shard_size=max_shard_size,
        init_fn=_randomise_1d_weights(SEED + 1),
    )
    return out


def build_sharded_copy(src: str | Path, out_dir: str | Path, max_shard_size: str = "60KB") -> Path:
    """Re-save checkpoint ``src`` as several safetensors shards + model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    copy_tokenizer(src, out)
    if not (out / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"save_pretrained did not shard {src} at {max_shard_size}")
    return out


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    for fname in TOKENIZER_FILES:
        if (Path(src) / fname).is_file():
            shutil.copy2(Path(src) / fname, Path(dst) / fname)


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A private copy a test may damage (missing file, wrong shape, other architecture)."""
    shutil.copytree(src, dst)
    return Path(dst)


def load_hf_model(path: str | Path) -> Any:
    """The transformers reference model of a checkpoint, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(path) / "config.json").read_text())
    # SDPA has no soft-cap: transformers computes a soft-capped model's attention eagerly
    eager = config.get("attn_logit_softcapping") is not None
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager" if eager else None
    )
    return model.eval()


class TinyCheckpoints:
    """Builds each test checkpoint at most once, on first request, under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._paths: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            self._paths[name] = build_test_checkpoint(name, self.root / name)
        return self._paths[name]

    def sharded(self, name: str) -> Path:
        key = f"{name}-sharded"
        if key not in self._paths:
            self._paths[key] = build_sharded_copy(self.path(name), self.root / key)
        return self._paths[key]


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers ``generate(do_sample=False)`` of one prompt, EOS stopping disabled.

    Returns the new tokens and, per step, ``log_softmax`` of the raw logits at the chosen
    token. Passing ``eos_token_id=None`` is not enough (generate falls back to the model's
    generation_config), so the model's own EOS is cleared for the call.
    """
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        model.generation_config.eos_token_id = saved
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def random_prompt(length: int, vocab_size: int, seed: int, low: int = 3) -> list[int]:
    """A reproducible prompt of ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size, (length,), generator=gen).tolist()


def perturbed_copy(src: str | Path, dst: str | Path, seed: int, scale: float = 0.05) -> Path:
    """A copy of safetensors checkpoint ``src`` whose every tensor moved by ``scale`` x N(0, 1) noise:
    the same model with other weights, as an RL step makes (weight update tests)."""
    from safetensors.torch import load_file, save_file

    out = copy_checkpoint(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        moved = {name: t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype) for name, t in tensors.items()}
        save_file(moved, str(path), metadata={"format": "pt"})
    return out
