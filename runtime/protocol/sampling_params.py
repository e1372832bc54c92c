"""Per-request sampling parameters: what a client may ask for, and their checks.

``SamplingParams`` is a msgspec Struct because it travels inside the msgspec messages
between processes (tokenizer -> scheduler). The tokenizer process builds it from the
client's dict with ``from_dict`` (type checks + range checks), so every later process can
trust the values. The names follow SGLang's so that SGLang users need no translation.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import msgspec

from runtime.protocol.field_refs import FieldRef, Message, as_message, render

# Temperatures below this are treated as greedy: dividing logits by a denormal-sized
# temperature overflows fp32, and the resulting distribution is one-hot anyway.
GREEDY_TEMPERATURE_EPS = 1e-6

# The sampling parameters that constrain the output to a grammar, in SGLang's names.
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf")

# logit_bias (OpenAI's): each bias is in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT], and a request may bias at
# most MAX_LOGIT_BIAS_ENTRIES tokens, which bounds what the sampler adds per request per step.
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# A logit_bias key: a decimal token id in ASCII (``int`` alone would also take " 7", "1_0" or Arabic digits).
_DECIMAL_ID = re.compile(r"-?[0-9]+")

_PATH_FIELD = re.compile(r"\$\.([A-Za-z_][A-Za-z0-9_]*)")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown, of the wrong type, or out of range.

    ``field`` names the offending parameter so the server can report it back to the
    client (and tests can assert on it) without parsing the message; ``parts`` is the message with
    the fields it names kept as references (``runtime.protocol.field_refs``), for a front door to
    word in its client's names.
    """

    def __init__(self, field: str, message: str | Message) -> None:
        self.parts: Message = (FieldRef(field, sampling=True), ": ", *as_message(message))
        super().__init__(render(self.parts))
        self.field = field


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, dict=True):
    """Sampling parameters of one request (SGLang names and defaults).

    ``dict=True`` gives instances a ``__dict__`` so that ``functools.cached_property`` can keep
    derived values (``logit_bias_entries``) with the request; it is never encoded.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # SGLang's: stop once the output's tail matches one of these (Python ``re``) patterns; the finish
    # reason's ``matched`` is the text that matched, which the reply's text leaves out (as a stop string)
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    top_logprobs_num: int = 0
    # Constrained decoding (at most one): the output must match a JSON schema (text), a regex
    # or an EBNF grammar (xgrammar's dialect of GBNF). Checked by ``runtime.text.grammar``.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI's logit_bias: {"<token id>": bias}, added to the logits of those tokens before
    # sampling (and before greedy's argmax). Keys are decimal strings, as in OpenAI's JSON.
    logit_bias: dict[str, float] | None = None

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a client's dict; raise SamplingParamsError naming the bad field.

        Conversion is strict: an int is accepted for a float field, but a bool is not an
        int, and a string is never a number ("abc" or "1.5" for temperature is rejected).
        """
        if d is None:
            params = cls()
        else:
            if not isinstance(d, dict):
                raise SamplingParamsError("<root>", f"expected a dict of sampling parameters, got {type(d).__name__}")
            for key in d:
                if not isinstance(key, str) or key not in cls.__struct_fields__:
                    raise SamplingParamsError(str(key), "unknown sampling parameter")
            if isinstance(d.get("json_schema"), dict):  # a schema given as an object, not as its text
                d = {**d, "json_schema": json.dumps(d["json_schema"])}
            try:
                params = msgspec.convert(d, cls, strict=True)
            except msgspec.ValidationError as exc:
                raise SamplingParamsError(_field_of(exc), str(exc)) from None
        params.validate()
        return params

    # ---- checks -------------------------------------------------------------------

    def validate(self, vocab_size: int | None = None) -> None:
        """Range checks; ``vocab_size`` (known only once a model is loaded) bounds token ids."""
        _finite("temperature", self.temperature)
        _check("temperature", self.temperature >= 0.0, self.temperature, "must be >= 0")
        _finite("top_p", self.top_p)
        _check("top_p", 0.0 < self.top_p <= 1.0, self.top_p, "must be in (0, 1]")
        _check("top_k", self.top_k == -1 or self.top_k >= 1, self.top_k, "must be -1 (off) or >= 1")
        _finite("min_p", self.min_p)
        _check("min_p", 0.0 <= self.min_p <= 1.0, self.min_p, "must be in [0, 1]")
        _check("max_new_tokens", self.max_new_tokens >= 0, self.max_new_tokens, "must be >= 0")
        _check("min_new_tokens", self.min_new_tokens >= 0, self.min_new_tokens, "must be >= 0")
        _check(
            "min_new_tokens",
            self.min_new_tokens <= self.max_new_tokens,
            self.min_new_tokens,
            ("must be <= ", FieldRef("max_new_tokens"), f" ({self.max_new_tokens})"),
        )
        _finite("repetition_penalty", self.repetition_penalty)
        _check("repetition_penalty", self.repetition_penalty > 0.0, self.repetition_penalty, "must be > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            _check(name, -2.0 <= value <= 2.0, value, "must be in [-2, 2]")
        _check("n", self.n >= 1, self.n, "must be >= 1")
        _check("top_logprobs_num", self.top_logprobs_num >= 0, self.top_logprobs_num, "must be >= 0")
        if vocab_size is not None:
            _check(
                "top_logprobs_num",
                self.top_logprobs_num <= vocab_size,
                self.top_logprobs_num,
                f"must be <= vocab size {vocab_size}",
            )
        if self.seed is not None:
            _check("seed", -(2**63) <= self.seed < 2**64, self.seed, "must fit in 64 bits")
        for s in self.stop_strs:
            _check("stop", len(s) > 0, s, "stop strings must be non-empty")
        _ = self.stop_patterns  # compiles them: refuses a pattern that is no regex or matches the empty text
        for tid in self.stop_token_ids or ():
            _check("stop_token_ids", tid >= 0, tid, "token ids must be >= 0")
            if vocab_size is not None:
                _check("stop_token_ids", tid < vocab_size, tid, f"must be < vocab size {vocab_size}")
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise SamplingParamsError(
                given[1], f"at most one of {', '.join(CONSTRAINT_KINDS)} may be given, got {' and '.join(given)}"
            )
        for name in given:
            _check(name, bool(getattr(self, name).strip()), getattr(self, name), "must not be empty")
        if self.logit_bias is not None:
            self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        """Bounded size, token ids in the vocabulary, finite biases in [-100, 100] (OpenAI's range)."""
        bias = self.logit_bias or {}
        _check(
            "logit_bias",
            len(bias) <= MAX_LOGIT_BIAS_ENTRIES,
            len(bias),
            f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased (entries)",
        )
        ids, values = self.logit_bias_entries  # refuses a key that is no decimal id, or a repeated id
        for tid, value in zip(ids, values):
            _check("logit_bias", tid >= 0, tid, "token ids must be >= 0")
            if vocab_size is not None:
                _check("logit_bias", tid < vocab_size, tid, f"token ids must be < vocab size {vocab_size}")
            _finite("logit_bias", value)
            _check(
                "logit_bias",
                -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT,
                value,
                f"biases must be in [{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
            )

    # ---- derived views ------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when the request's next token is the argmax of its (penalised) logits."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        """``stop`` normalised to a list (empty when unset)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    @functools.cached_property
    def stop_patterns(self) -> tuple[re.Pattern[str], ...]:
        """``stop_regex`` compiled (empty when unset), once per process. A pattern matching the empty
        text would end every request at its first token: refused."""
        given = [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or ())
        patterns = []
        for text in given:
            try:
                pattern = re.compile(text)
            except re.error as exc:
                raise SamplingParamsError("stop_regex", f"not a regular expression ({exc}), got {text!r}") from None
            _check("stop_regex", pattern.fullmatch("") is None, text, "must not match the empty text")
            patterns.append(pattern)
        return tuple(patterns)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the request's output constraint (kind: one of ``CONSTRAINT_KINDS``)."""
        for kind in CONSTRAINT_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @functools.cached_property
    def logit_bias_entries(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """``logit_bias`` as (token ids, biases), both empty when unset.

        Cached on the request's params so the sampler, which builds a batch's bias every step,
        never re-parses the string keys (each process parses once: the cache is not encoded).
        ``logit_bias`` must not be changed after the first read.
        """
        return _parse_logit_bias(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _field_of(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    m = _PATH_FIELD.search(text) or _UNKNOWN_FIELD.search(text)
    return m.group(1) if m else "<root>"


def _parse_logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Token ids of ``bias``'s keys, with their biases; SamplingParamsError("logit_bias") for a key that
    is not a decimal integer or names an id twice ("7" and "07"), whose biases would silently add up."""
    if not bias:
        return (), ()
    ids: list[int] = []
    seen: set[int] = set()
    for key in bias:
        _check("logit_bias", _DECIMAL_ID.fullmatch(key) is not None, key, "keys must be decimal token ids")
        tid = int(key)
        _check("logit_bias", tid not in seen, key, f"token id {tid} is biased twice")
        seen.add(tid)
        ids.append(tid)
    return tuple(ids), tuple(float(v) for v in bias.values())


def _finite(name: str, value: float) -> None:
    _check(name, math.isfinite(value), value, "must be a finite number")


def _check(name: str, ok: bool, value: object, problem: str | Message) -> None:
    if not ok:
        raise SamplingParamsError(name, (*as_message(problem), f", got {value!r}"))
