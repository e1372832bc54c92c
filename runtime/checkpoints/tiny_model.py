"""The embedded default model: a small random Llama plus a BPE tokenizer, built on first use.

With no ``--model-path`` the server needs *some* checkpoint without network access, so one
is built deterministically (fixed seed, tokenizer trained on an embedded corpus) into the
user cache folder and then loaded like any other HF checkpoint folder. Building twice
gives byte-identical files, and concurrent first uses are safe: each builds into its own
temporary folder and the first atomic rename wins.

The builders (``train_bpe_tokenizer``, ``build_checkpoint``) are reused by the tests to
make tiny Llama / Mistral / Qwen2 / Qwen3 checkpoints.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from runtime.checkpoints.model_cache import build_once, cache_root

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# Bump when anything below changes what is built: the cache folder name includes it.
TINY_MODEL_VERSION = 1
TINY_MODEL_NAME = f"tiny-llama-v{TINY_MODEL_VERSION}"
TINY_MODEL_SEED = 20240611
_RNG_LOCK = threading.Lock()

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 0..5 in this order

# Qwen2's pre-tokenizer split: digits one by one, letters runs, punctuation runs, spaces.
QWEN_SPLIT_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
CHAT_TEMPLATE_NO_BOS = CHAT_TEMPLATE.removeprefix("{{ bos_token }}")

# ---- the embedded corpus -------------------------------------------------------------

_SUBJECTS = (
    "the model",
    "a server",
    "the scheduler",
    "every request",
    "the tokenizer",
    "a small cat",
    "the river",
    "my friend",
    "the old library",
    "our team",
    "the cache",
    "a quiet village",
    "the compiler",
    "this kernel",
    "the teacher",
    "a bright star",
    "the garden",
    "each worker",
    "the network",
    "a curious child",
)
_VERBS = (
    "reads",
    "writes",
    "builds",
    "sends",
    "finds",
    "keeps",
    "moves",
    "opens",
    "checks",
    "waits for",
    "returns",
    "learns",
    "follows",
    "counts",
    "shares",
    "stores",
    "answers",
    "measures",
    "draws",
    "loads",
)
_OBJECTS = (
    "the next token",
    "a long prompt",
    "seven apples",
    "the blue door",
    "a memory page",
    "the final answer",
    "an old map",
    "the evening news",
    "a batch of numbers",
    "the shortest path",
    "a warm cup of tea",
    "the attention scores",
    "a list of words",
    "the first chapter",
    "a hidden message",
    "the latest report",
)
_TAILS = (
    "before noon.",
    "without a sound.",
    "in the morning.",
    "again and again.",
    "with great care.",
    "as fast as it can.",
    "when the bell rings.",
    "after the rain.",
    "for the whole team.",
    "every day.",
)
_FIXED_TEXT = """Hello! How are you today? I am fine, thank you.
The quick brown fox jumps over the lazy dog.
Once upon a time, in a land far away, there lived a wise old owl.
Question: What is 12 plus 30? Answer: 42.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"name": "tinyserve", "version": 1, "tags": ["llm", "serving"]}
User: Tell me a story about the sea.
Assistant: The sea was calm, and the sky was full of stars.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 -7 +8 50%
Punctuation: , . ; : ! ? ' " ( ) [ ] { } < > / \\ | @ # $ % ^ & * - _ = +
"""


_WORDS = tuple(
    """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy moment
air teacher force education foot boy age policy process music market sense nation plan college interest
death experience effect use class control care field development role effort rate heart drug show leader
light voice wife police mind price report decision son view relationship town road arm difference value
building action model season society tax director position player record paper space ground form event official
matter center couple site project activity star table need court oil situation cost industry figure street
image phone data picture practice piece land product doctor wall patient worker news test movie north
love support technology step baby computer type attention film tree source organization hair window evidence population
truth song river garden kitchen bridge mountain island forest ocean desert valley village castle ship train
engine machine kernel memory token server request cache batch tensor layer network scheduler compiler matrix vector
signal queue be have do say go get make know think take see come want look
give find tell ask seem feel try leave call keep let begin help talk turn start
show hear play run move like live believe hold bring happen write provide sit stand lose
pay meet include continue set learn lead understand watch follow stop create speak read allow add
spend grow open walk win offer remember consider appear buy wait serve die send expect build
stay fall cut reach kill remain suggest raise pass sell require decide return explain hope develop
carry break receive agree support hit produce eat cover catch draw choose cause point listen realize
place close involve increase sing swim jump climb paint cook good new first last long great
little own other old right big high different small large next early young important few public
bad same able free sure clear full simple strong certain quick quiet bright dark warm cold
happy brave careful gentle heavy light soft hard green blue red yellow white black golden silver
ancient modern tiny huge always never often sometimes usually already still again soon today tomorrow yesterday
here there everywhere however because although while since unless until before after during within without between
among across
""".split()
)


def embedded_corpus(num_sentences: int = 6000, seed: int = 7) -> list[str]:
    """A deterministic English-like corpus: fixed text, template sentences and word salad.

    Seeded, so the trained tokenizer (and with it the default model) is the same on
    every machine; varied enough for a BPE vocabulary of a few thousand tokens.
    """
    rng = random.Random(seed)
    lines = _FIXED_TEXT.splitlines()
    for i in range(num_sentences):
        if i % 2 == 0:
            sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        else:
            n = rng.randint(4, 14)
            sentence = " ".join(rng.choice(_WORDS) for _ in range(n)) + rng.choice((".", "!", "?", ",", ";"))
        if i % 3 == 0:
            sentence = sentence[0].upper() + sentence[1:]
        if i % 11 == 0:
            sentence += f" It took {rng.randint(1, 999)} steps and {rng.randint(0, 59)} seconds."
        lines.append(sentence)
    return lines


# ---- builders ------------------------------------------------------------------------


def train_bpe_tokenizer(
    vocab_size: int,
    out_dir: str | Path,
    qwen_split: bool = False,
    add_bos: bool = True,
    model_max_length: int = 2048,
    corpus: list[str] | None = None,
) -> dict[str, int]:
    """Train a byte-level BPE tokenizer and save it as an HF tokenizer folder.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (PreTrainedTokenizerFast, special
    tokens, chat template) and ``special_tokens_map.json``; loadable with AutoTokenizer.
    ``qwen_split`` uses Qwen2's NFC + split regex (digits split one by one) so that
    transformers' Qwen2 tokenizer class, which rebuilds that pipeline, tokenizes the same.
    Returns ``{"vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"}``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    if qwen_split:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else embedded_corpus(), trainer=trainer)
    ids: dict[str, int] = {}
    for name in (PAD, BOS, EOS):
        token_id = tok.token_to_id(name)
        assert token_id is not None  # (the trainer put every special token in the vocabulary)
        ids[name] = token_id
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, ids[BOS])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE if add_bos else CHAT_TEMPLATE_NO_BOS,
        "additional_special_tokens": list(ROLE_TOKENS),
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": list(ROLE_TOKENS)},
    )
    return {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "pad_token_id": ids[PAD],
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
    }


def build_checkpoint(
    config: "PretrainedConfig",
    out_dir: str | Path,
    seed: int,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    auto_class: Any = None,
) -> Path:
    """Random-initialise ``auto_class.from_config(config)`` (default ``AutoModelForCausalLM``; an
    encoder's ``AutoModel`` or ``AutoModelForSequenceClassification``) under ``seed`` and save it.

    Uses transformers' own init and ``save_pretrained`` (safetensors), so the folder is a
    genuine HF checkpoint: config.json with ``architectures``, generation_config.json.
    ``init_fn`` may then change weights in place (tests randomise norm scales and biases).
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # transformers' init draws from the global torch RNG: hold it alone while seeding and drawing.
    with _RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (auto_class or AutoModelForCausalLM).from_config(config, dtype=torch.float32)
        if init_fn is not None:
            init_fn(model)
    model = model.to(dtype)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    return out


def tiny_llama_config(tokenizer_info: dict[str, int]) -> "PretrainedConfig":
    """The default model's shape: hidden 256, 4 layers, 8 heads / 4 KV heads, context 2048."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer_info["vocab_size"],
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        # transformers 5 takes the old-style rope_theta through its **kwargs (its typed fields name
        # rope_parameters instead, which 4.x, also supported, lacks).
        rope_theta=10000.0,  # type: ignore[call-arg]
        tie_word_embeddings=False,
        bos_token_id=tokenizer_info["bos_token_id"],
        eos_token_id=tokenizer_info["eos_token_id"],
        pad_token_id=tokenizer_info["pad_token_id"],
        initializer_range=0.05,
    )


def build_tiny_model(out_dir: str | Path) -> Path:
    """Build the default model (tokenizer + bf16 weights) into ``out_dir``."""
    out = Path(out_dir)
    info = train_bpe_tokenizer(vocab_size=2048, out_dir=out, model_max_length=2048)
    build_checkpoint(tiny_llama_config(info), out, seed=TINY_MODEL_SEED, dtype=torch.bfloat16)
    return out


def default_model_path() -> Path:
    """The default checkpoint folder, built on first use (atomic, safe under concurrency)."""
    return build_once(cache_root() / TINY_MODEL_NAME, build_tiny_model, "the embedded default model")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
