"""Parsing and compiling constraints with xgrammar, and the compiled-grammar cache.

A JSON schema is compiled without free whitespace (xgrammar's ``any_whitespace=False``:
``", "`` and ``": "`` separators): a small model given free whitespace can spend its whole
budget on newlines, and fixed separators are text the grammar forces, which jump-forward
then appends without a decode step.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import xgrammar as xgr

# Compiled grammars kept per scheduler process; the least recently used one goes first.
GRAMMAR_CACHE_ENTRIES = 256

_CXX_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A constraint that does not parse or compile; ``kind`` is the sampling parameter
    (``json_schema``, ``regex``, ``ebnf``) and the message says what is wrong with it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.reason = message  # (the message without the kind: a caller may name the kind its own way)


def _reason(exc: BaseException) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CXX_PREFIX.sub("", text)


# What a length-bounded JSON string may hold: any character but '"', '\\' and the control
# characters JSON forbids raw (xgrammar 0.2.8 lets the latter through; see bounded_strings).
_BOUNDED_STRING_CHAR = r'[^"\\\x00-\x1f]'
# Values that are data, not subschemas: never rewritten.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords whose value maps names (a property called "enum" included) to subschemas.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def bounded_strings(schema: Any) -> Any:
    """``schema`` with every ``minLength``/``maxLength`` string (no pattern or format of its own)
    given the equivalent ``pattern`` over characters JSON allows raw.

    xgrammar 0.2.8 compiles a length-bounded string to ``[^"\\\r\n]{m,n}``, which admits raw
    control characters, so a model could write JSON no parser accepts (mlc-ai/xgrammar#800).
    Such strings cannot hold escapes there either, so the pattern only removes the invalid ones.
    """
    if isinstance(schema, list):
        return [bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rewrite_member(key, value) for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format"} & out.keys():
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)  # the pattern says them
        out["pattern"] = f"^{_BOUNDED_STRING_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out


def _rewrite_member(key: str, value: Any) -> Any:
    if key in _DATA_KEYWORDS:
        return value
    if key in _NAMED_SCHEMAS and isinstance(value, dict):  # its keys are names, its values schemas
        return {name: bounded_strings(sub) for name, sub in value.items()}
    return bounded_strings(value)


def parse_constraint(kind: str, text: str) -> xgr.Grammar:
    """``text`` as a grammar of ``kind`` (``json_schema``, ``regex``, ``ebnf``); GrammarError
    naming what is wrong when it does not parse."""
    if kind not in _NAMES:
        raise GrammarError(kind, "unknown constraint kind")
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as exc:
                raise GrammarError(kind, f"invalid JSON schema: not JSON: {exc}") from None
            return xgr.Grammar.from_json_schema(json.dumps(bounded_strings(schema)), any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar reports every parse error as a RuntimeError
        raise GrammarError(kind, f"invalid {_NAMES[kind]}: {_reason(exc)}") from None


def check_constraint(kind: str, text: str) -> None:
    """Raise GrammarError unless ``text`` parses as a constraint of ``kind``."""
    parse_constraint(kind, text)


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar, ready for matchers, and how it was had."""

    grammar: xgr.CompiledGrammar
    seconds: float  # compile time (0 on a cache hit)
    cache_hit: bool


class GrammarBackend:
    """The served vocabulary as xgrammar sees it, and compiled grammars by (kind, text).

    Thread-safe: compiles run on the scheduler's grammar thread(s); the cache is shared.
    ``vocab_size`` is the logits' width (the model's vocabulary, which may be larger than
    the tokenizer's: tokens without text are never allowed). ``stop_token_ids`` are the
    tokens that end a complete output (the model's EOS ids).
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], cache_entries: int = GRAMMAR_CACHE_ENTRIES
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # xgrammar's own cache is off: ours is bounded by entries and counts its hits.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str) -> Compiled:
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return Compiled(hit, 0.0, True)
        start = time.perf_counter()
        grammar = parse_constraint(kind, text)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(kind, f"invalid {_NAMES[kind]}: {_reason(exc)}") from None
        seconds = time.perf_counter() - start
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return Compiled(compiled, seconds, False)

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)
