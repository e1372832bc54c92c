"""Constrained decoding pieces on their own: constraint checks, the constraint sampling
parameters, the token-bitmask kernels against a plain Python reference, the sampler with a
vocabulary mask, and the grammar backend / matcher on the tiny checkpoint's real tokenizer."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr

from runtime.engine.cpu.ops import CpuOps
from runtime.engine.ops.torch_ops import TorchOps
from runtime.engine.sampling import penalties as pen
from runtime.engine.sampling.batch_info import SamplingBatchInfo
from runtime.engine.sampling.sampler import Sampler
from runtime.protocol.sampling_params import SamplingParams, SamplingParamsError
from runtime.text.grammar import GrammarBackend, GrammarError, RequestGrammar, allocate_bitmask, check_constraint

# A C++ source location as xgrammar's messages start: "[11:28:42] /project/cpp/regex_converter.cc:83: ".
CXX_LOCATION = re.compile(r"\[[0-9:]+\]|\.cc:\d+|/project/")

EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


# ---- check_constraint -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,text",
    [
        ("json_schema", json.dumps(PERSON)),
        ("json_schema", '{"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}'),
        ("regex", EMAIL),
        ("regex", r"\d{1,3}(\.\d{1,3}){3}"),
        ("ebnf", 'root ::= "yes" | "no"'),
        ("ebnf", 'root ::= item ("," item)*\nitem ::= [a-z]+'),
    ],
)
def test_check_constraint_accepts_valid(kind: str, text: str) -> None:
    check_constraint(kind, text)  # no exception


@pytest.mark.parametrize(
    "kind,text,name,detail",
    [
        ("json_schema", '{"type": "objectx"}', "JSON schema", "objectx"),
        ("json_schema", "{not json", "JSON schema", "not JSON"),
        ("regex", "[a-z", "regular expression", "Unclosed '['"),
        ("regex", "(ab", "regular expression", "parenthesis"),
        ("ebnf", "root ::= undefined_rule", "EBNF grammar", "undefined_rule"),
        ("ebnf", 'root ::= "unterminated', "EBNF grammar", "string literal"),
    ],
)
def test_check_constraint_rejects_invalid(kind: str, text: str, name: str, detail: str) -> None:
    with pytest.raises(GrammarError) as ei:
        check_constraint(kind, text)
    message = str(ei.value)
    assert ei.value.kind == kind
    assert message.startswith(f"{kind}: invalid {name}: "), message
    assert detail in message
    assert not CXX_LOCATION.search(message), f"C++ location left in {message!r}"
    assert "\n" not in message


def test_check_constraint_unknown_kind() -> None:
    with pytest.raises(GrammarError) as ei:
        check_constraint("grammar", "x")
    assert ei.value.kind == "grammar"


# ---- SamplingParams -----------------------------------------------------------------------


def test_json_schema_object_becomes_its_text() -> None:
    p = SamplingParams.from_dict({"json_schema": PERSON, "temperature": 0.0})
    assert isinstance(p.json_schema, str)
    assert json.loads(p.json_schema) == PERSON
    assert p.constraint == ("json_schema", p.json_schema)
    check_constraint(*p.constraint)
    # Text stays text, untouched.
    text = '{"type":  "string"}'
    assert SamplingParams.from_dict({"json_schema": text}).json_schema == text


@pytest.mark.parametrize(
    "kind,text", [("regex", EMAIL), ("ebnf", 'root ::= "a"'), ("json_schema", '{"type": "integer"}')]
)
def test_constraint_property(kind: str, text: str) -> None:
    assert SamplingParams.from_dict({kind: text}).constraint == (kind, text)
    assert SamplingParams.from_dict({}).constraint is None


@pytest.mark.parametrize(
    "given,second",
    [
        ({"json_schema": '{"type": "string"}', "regex": "a+"}, "regex"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
        ({"json_schema": PERSON, "ebnf": 'root ::= "a"'}, "ebnf"),
        ({"json_schema": "{}", "regex": "a", "ebnf": 'root ::= "a"'}, "regex"),
    ],
)
def test_two_constraints_rejected_naming_the_second(given: dict[str, Any], second: str) -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict(given)
    assert ei.value.field == second
    assert "at most one" in str(ei.value)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
@pytest.mark.parametrize("text", ["", "   ", "\n"])
def test_empty_constraint_rejected(kind: str, text: str) -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict({kind: text})
    assert ei.value.field == kind
    assert "must not be empty" in str(ei.value)


# ---- apply_token_bitmask ----------------------------------------------------------------


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, ceil(cols / 32)] from bool [rows, cols]: bit t % 32 of word t // 32 = allowed."""
    rows, cols = allowed.shape
    words = (cols + 31) // 32
    out = torch.zeros(rows, words, dtype=torch.int32)
    for r in range(rows):
        for w in range(words):
            value = 0
            for b in range(32):
                t = w * 32 + b
                if t < cols and allowed[r, t]:
                    value |= 1 << b
            out[r, w] = value - (1 << 32) if value >= 1 << 31 else value
    return out


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """Plain Python: -inf where the token's bit is clear, on ``rows`` (None: all)."""
    out = logits.clone()
    for r in range(logits.shape[0]) if rows is None else rows:
        for t in range(logits.shape[1]):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


OPS = {"torch": TorchOps, "cpu": CpuOps}


@pytest.mark.parametrize("ops_name", sorted(OPS))
@pytest.mark.parametrize("cols", [97, 384])
@pytest.mark.parametrize("rows", [None, [1, 3, 4], [0], [5]], ids=["all", "some", "first", "last"])
def test_apply_token_bitmask_matches_reference(ops_name: str, cols: int, rows: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(cols * 7 + (len(rows) if rows else 0))
    logits = torch.randn(6, cols, generator=gen)
    allowed = torch.rand(6, cols, generator=gen) < 0.3
    allowed[:, 31] = True  # bit 31: the sign bit of an int32 word
    allowed[:, 63 % cols] = False
    bitmask = pack_bitmask(allowed)
    assert int(bitmask[0, 0]) < 0  # the sign bit really is exercised
    want = reference_apply(logits, bitmask, rows)
    got = logits.clone()
    OPS[ops_name]().apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)
    untouched = [r for r in range(6) if rows is not None and r not in rows]
    assert torch.equal(got[untouched], logits[untouched])  # bitwise: rows not listed are left alone
    # A listed row: exactly the disallowed tokens became -inf, the others kept their value.
    r = 0 if rows is None else rows[0]
    assert torch.equal(torch.isneginf(got[r]), ~allowed[r])
    assert torch.equal(got[r][allowed[r]], logits[r][allowed[r]])


def test_apply_token_bitmask_xgrammar_layout() -> None:
    """The reference's bit layout is xgrammar's: a matcher's filled row, read by the reference,
    allows exactly the tokens the matcher accepts."""
    vocab = ["a", "b", "ab", "ba", "c", "</s>"] + [f"<x{i}>" for i in range(40)]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[5])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "ab" "c"')
    mask = allocate_bitmask(1, len(vocab))
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
    masked = reference_apply(torch.zeros(1, len(vocab)), mask, None)[0]
    allowed = {t for t in range(len(vocab)) if masked[t] == 0}
    assert allowed == {0, 2}  # "a" and "ab"
    for ops in (TorchOps(), CpuOps()):
        got = torch.zeros(1, len(vocab))
        ops.apply_token_bitmask(got, mask, None)
        assert torch.equal(got[0], masked)


# ---- Sampler with a vocabulary mask -------------------------------------------------------


class SpyOps(TorchOps):
    """TorchOps that records its bitmask calls."""

    def __init__(self) -> None:
        self.bitmask_calls: list[list[int] | None] = []

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
        self.bitmask_calls.append(rows)
        super().apply_token_bitmask(logits, bitmask, rows)


def info_for(
    params: list[SamplingParams],
    vocab: int,
    mask: torch.Tensor | None = None,
    mask_rows: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingBatchInfo:
    bs = len(params)
    return SamplingBatchInfo.from_requests(
        params,
        prompts or [[] for _ in range(bs)],
        outputs or [[] for _ in range(bs)],
        vocab,
        [],
        "cpu",
        vocab_mask=mask,
        vocab_mask_rows=mask_rows,
    )


def test_greedy_with_mask_takes_best_allowed_token() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab = 97
    logits = torch.randn(5, vocab, generator=gen)
    allowed = torch.rand(5, vocab, generator=gen) < 0.2
    allowed[:, logits.argmax(-1)] = False  # the unconstrained argmax is never allowed
    allowed[:, 3] = True
    rows = [0, 2, 3]
    spy = SpyOps()
    out = Sampler(ops=spy)(logits, info_for([SamplingParams(temperature=0.0)] * 5, vocab, pack_bitmask(allowed), rows))
    for r in range(5):
        if r in rows:
            best = logits[r].masked_fill(~allowed[r], float("-inf")).argmax()
            assert out.next_token_ids[r] == best and allowed[r, out.next_token_ids[r]]
        else:
            assert out.next_token_ids[r] == logits[r].argmax()
    assert spy.bitmask_calls == [rows]
    # Every row constrained: the rows list is dropped (None = all rows), same result on those rows.
    all_rows = info_for([SamplingParams(temperature=0.0)] * 5, vocab, pack_bitmask(allowed), list(range(5)))
    assert all_rows.vocab_mask_rows is None
    out_all = Sampler(ops=spy)(logits, all_rows)
    assert torch.equal(out_all.next_token_ids[rows], out.next_token_ids[rows])
    assert all(allowed[r, out_all.next_token_ids[r]] for r in range(5))


def test_masked_tokens_never_sampled() -> None:
    vocab, draws = 40, 4000
    logits = torch.linspace(-2.0, 2.0, vocab)  # the highest logits are the disallowed ones
    allowed_ids = [0, 7, 19, 23]
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[allowed_ids] = True
    batch = logits.expand(draws, vocab).contiguous()
    mask = pack_bitmask(allowed.expand(draws, vocab))
    sampler = Sampler(generator=torch.Generator().manual_seed(5))
    ids = sampler(batch, info_for([SamplingParams(temperature=1.0)] * draws, vocab, mask)).next_token_ids
    counts = torch.bincount(ids, minlength=vocab)
    assert counts[~allowed].sum() == 0, "a disallowed token was sampled"
    # Among the allowed tokens the draws follow the renormalised softmax (chi-square, 3 df, p = 0.001).
    probs = torch.softmax(logits[allowed_ids].double(), -1)
    expected = probs * draws
    stat = float(((counts[allowed_ids].double() - expected) ** 2 / expected).sum())
    assert stat < 16.266, stat
    # Seeded rows too (a different noise path).
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(500)]
    ids = sampler(batch[:500], info_for(seeded, vocab, mask[:500])).next_token_ids
    assert bool(allowed[ids].all())


def test_fast_path_unchanged_without_mask() -> None:
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 50, generator=gen)
    info = info_for([SamplingParams(temperature=0.0)] * 4, 50)
    assert info.vocab_mask is None and info.vocab_mask_rows is None
    spy = SpyOps()
    before = logits.clone()
    out = Sampler(ops=spy)(logits, info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert spy.bitmask_calls == []
    assert torch.equal(logits, before)
    # With a mask the caller's buffer is not written either (the mask goes on a private copy).
    some_allowed = pack_bitmask(torch.rand(4, 50, generator=gen) < 0.5)
    masked_info = info_for([SamplingParams(temperature=0.0)] * 4, 50, some_allowed)
    Sampler(ops=spy)(logits, masked_info)
    assert torch.equal(logits, before) and spy.bitmask_calls == [None]


def test_penalties_do_not_resurrect_masked_tokens() -> None:
    """Penalties that would lift a masked token to the top leave it at -inf, and the allowed
    tokens get exactly their penalised values. (With a -inf mask and elementwise penalties the
    order of the two cannot show in the result: this pins the outcome, not the order.)"""
    vocab = 10
    logits = torch.tensor([[1.0, 2.0, -3.0, 0.5, 4.0, -1.0, 0.0, 1.5, -0.5, 0.2]] * 3)
    allowed = torch.ones(3, vocab, dtype=torch.bool)
    allowed[:, [4, 2]] = False  # the best logit (4) and a seen negative one (2)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=0.1),  # seen tokens x10 / /0.1
        SamplingParams(temperature=0.0, frequency_penalty=-2.0, presence_penalty=-2.0),
        SamplingParams(temperature=0.0),
    ]  # free row of the same batch: unmasked, unpenalised
    history = [[2, 4, 4, 4], [2, 4, 4, 4], [2, 4]]
    mask = pack_bitmask(allowed)
    info = info_for(params, vocab, mask, [0, 1], prompts=[[] for _ in range(3)], outputs=history)
    sampler = Sampler()
    adjusted = sampler.penalized_logits(logits, info)
    for r in (0, 1):
        assert torch.isneginf(adjusted[r, [2, 4]]).all()
    seen = pen.token_presence([history[0]], vocab, torch.device("cpu"))
    want0 = pen.apply_repetition_penalty(logits[:1], seen, torch.tensor([[0.1]]))[0]
    counts = pen.token_counts([history[1]], vocab, torch.device("cpu"))
    want1 = pen.apply_frequency_presence_penalties(logits[1:2], counts, torch.tensor([[-2.0]]), torch.tensor([[-2.0]]))[
        0
    ]
    keep = allowed[0]
    assert torch.equal(adjusted[0, keep], want0[keep])
    assert torch.equal(adjusted[1, keep], want1[keep])
    assert torch.equal(adjusted[2], logits[2])
    # Without the mask the penalties would have made token 4 the choice of rows 0 and 1.
    unmasked = info_for(params, vocab, None, None, prompts=[[] for _ in range(3)], outputs=history)
    assert sampler(logits, unmasked).next_token_ids.tolist()[:2] == [4, 4]
    assert sampler(logits, info).next_token_ids.tolist() == [
        int(want0.masked_fill(~keep, -1e9).argmax()),
        int(want1.masked_fill(~keep, -1e9).argmax()),
        4,
    ]


def test_min_new_tokens_mask_stacks_with_grammar_mask() -> None:
    vocab, eos = 12, 11
    logits = torch.zeros(1, vocab)
    logits[0, eos], logits[0, 5], logits[0, 6] = 5.0, 3.0, 4.0
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [5, eos]] = True
    info = SamplingBatchInfo.from_requests(
        [SamplingParams(temperature=0.0, min_new_tokens=2)],
        [[1]],
        [[]],
        vocab,
        [eos],
        "cpu",
        vocab_mask=pack_bitmask(allowed),
    )
    adjusted = Sampler().penalized_logits(logits, info)[0]
    assert torch.isneginf(adjusted[eos]) and torch.isneginf(adjusted[6])  # min_new_tokens, grammar
    assert Sampler()(logits, info).next_token_ids.tolist() == [5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_that_allows_only_stop_overrides_min_new_tokens(temperature: float) -> None:
    """A complete grammar that allows nothing but the stop token, before min_new_tokens: the
    min_new_tokens suppression would leave no token at all (every logit -inf, argmax picks token
    0, which the grammar refuses). The grammar wins: the stop token is sampled. Rows where the
    grammar leaves another token keep the suppression, and free rows are untouched."""
    vocab, eos = 12, 11
    logits = torch.zeros(3, vocab)
    logits[:, 6] = 4.0
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[0, eos] = True  # complete: only the stop token
    allowed[1, [5, eos]] = True  # may stop or go on
    params = [SamplingParams(temperature=temperature, min_new_tokens=4, seed=1)] * 3
    info = SamplingBatchInfo.from_requests(
        params, [[1]] * 3, [[]] * 3, vocab, [eos], "cpu", vocab_mask=pack_bitmask(allowed), vocab_mask_rows=[0, 1]
    )
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    for _ in range(20 if temperature else 1):
        assert sampler(logits, info).next_token_ids.tolist() == [eos, 5, 6]
    adjusted = sampler.penalized_logits(logits, info)
    assert adjusted[0, eos] == 0.0 and torch.isneginf(adjusted[0, :eos]).all()
    assert torch.isneginf(adjusted[1, eos]) and torch.isneginf(adjusted[2, eos])  # min_new_tokens holds


# ---- GrammarBackend / RequestGrammar on a real tokenizer ----------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Any:
    from runtime.text.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_llama_path))


@pytest.fixture(scope="module")
def vocab_size(tiny_llama_path: Path) -> int:
    return int(json.loads((tiny_llama_path / "config.json").read_text())["vocab_size"])


@pytest.fixture
def backend(tokenizer: Any, vocab_size: int) -> GrammarBackend:
    return GrammarBackend(tokenizer, vocab_size, [tokenizer.eos_token_id], cache_entries=2)


def allowed_ids(grammar: RequestGrammar, vocab_size: int) -> set[int]:
    mask = allocate_bitmask(1, vocab_size)
    grammar.fill(mask, 0)
    row = reference_apply(torch.zeros(1, vocab_size), mask, None)[0]
    return {t for t in range(vocab_size) if row[t] == 0}


def test_compile_is_cached(backend: GrammarBackend) -> None:
    first = backend.compile("regex", EMAIL)
    assert not first.cache_hit and first.seconds > 0
    again = backend.compile("regex", EMAIL)
    assert again.cache_hit and again.seconds == 0.0
    assert again.grammar is first.grammar
    assert backend.cached() == 1
    # The same text under another kind is another grammar.
    other = backend.compile("ebnf", 'root ::= "a"')
    assert not other.cache_hit and backend.cached() == 2


def test_cache_is_bounded_lru(backend: GrammarBackend) -> None:
    a, b, c = ("regex", "a+"), ("regex", "b+"), ("regex", "c+")
    backend.compile(*a)
    backend.compile(*b)
    backend.compile(*c)  # evicts a, the oldest
    assert backend.cached() == 2
    assert backend.compile(*c).cache_hit and backend.compile(*b).cache_hit
    assert not backend.compile(*a).cache_hit  # recompiled; evicts c (b was used more recently)
    assert backend.cached() == 2
    assert backend.compile(*b).cache_hit and backend.compile(*a).cache_hit
    assert not backend.compile(*c).cache_hit


def test_compile_error_names_kind_and_is_not_cached(backend: GrammarBackend) -> None:
    with pytest.raises(GrammarError) as ei:
        backend.compile("regex", "[a-z")
    assert ei.value.kind == "regex" and str(ei.value).startswith("regex: invalid regular expression: ")
    assert not CXX_LOCATION.search(str(ei.value))
    assert backend.cached() == 0


def test_matcher_accepts_valid_tokens_and_terminates_on_stop(
    backend: GrammarBackend, tokenizer: Any, vocab_size: int
) -> None:
    grammar = RequestGrammar(backend.compile("regex", EMAIL))
    eos = tokenizer.eos_token_id
    assert eos not in allowed_ids(grammar, vocab_size)
    tokens = tokenizer.encode("abc@xy.com", add_special_tokens=False)
    assert len(tokens) > 3
    for token in tokens:
        assert token in allowed_ids(grammar, vocab_size)
        assert grammar.accept(token)
        assert not grammar.terminated
    assert eos in allowed_ids(grammar, vocab_size)  # the text is a complete match
    assert grammar.accept(eos)
    assert grammar.terminated
    assert not grammar.accept(tokens[0])  # nothing after the stop token


def test_matcher_refuses_invalid_token_state_unchanged(
    backend: GrammarBackend, tokenizer: Any, vocab_size: int
) -> None:
    grammar = RequestGrammar(backend.compile("regex", EMAIL))
    (at,) = tokenizer.encode("@", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert grammar.accept(token)
    before = allowed_ids(grammar, vocab_size)
    assert at not in before and eos not in before  # "ab@" is too short: 3 letters needed
    assert not grammar.accept(at)
    assert not grammar.accept(eos)
    assert not grammar.terminated
    assert allowed_ids(grammar, vocab_size) == before
    # And it goes on exactly as if the refused tokens had never been offered.
    for token in tokenizer.encode("c@xy.org", add_special_tokens=False):
        assert grammar.accept(token)
    assert grammar.accept(eos) and grammar.terminated


def test_forced_tokens(backend: GrammarBackend, tokenizer: Any) -> None:
    compiled = backend.compile("json_schema", json.dumps(PERSON))
    forced_text = xgr.GrammarMatcher(compiled.grammar).find_jump_forward_string()
    assert forced_text == '{"name": "'  # fixed separators: no free whitespace
    grammar = RequestGrammar(compiled)
    forced = grammar.forced_tokens(tokenizer, 100)
    assert forced
    text = tokenizer.decode(forced)
    assert forced_text.startswith(text) and len(text) < len(forced_text)  # the last token is left to the model
    # The matcher took them: what is still forced is the rest of the text.
    probe = xgr.GrammarMatcher(compiled.grammar)
    for token in forced:
        assert probe.accept_token(token)
    assert text + probe.find_jump_forward_string() == forced_text
    # limit: a prefix of the same split, at most ``limit`` tokens.
    for limit in (0, 1, 2, len(forced) - 1):
        limited = RequestGrammar(compiled).forced_tokens(tokenizer, limit)
        assert limited == forced[:limit]
    # Nothing forced where the model must choose (inside the string), nor after termination.
    regex = RequestGrammar(backend.compile("regex", EMAIL))
    assert regex.forced_tokens(tokenizer, 10) == []
    for token in tokenizer.encode("abc@xy.com", add_special_tokens=False):
        assert regex.accept(token)
    assert regex.accept(tokenizer.eos_token_id) and regex.terminated
    assert regex.forced_tokens(tokenizer, 10) == []


def test_forced_tokens_of_fixed_structure(backend: GrammarBackend, tokenizer: Any) -> None:
    """A grammar that is all fixed text: every token but the last is forced, and taking the
    rest by hand completes it."""
    text = '{"kind": "fixed", "n": 1}'
    grammar = RequestGrammar(backend.compile("ebnf", f"root ::= {json.dumps(text)}"))
    forced = grammar.forced_tokens(tokenizer, 1000)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert forced == ids[:-1]
    assert grammar.accept(ids[-1]) and grammar.accept(tokenizer.eos_token_id) and grammar.terminated


def test_bitmask_rows_are_independent(backend: GrammarBackend, tokenizer: Any, vocab_size: int) -> None:
    """Filling row i touches only row i (the batch builder fills the constrained rows of one mask)."""
    mask = allocate_bitmask(3, vocab_size)
    full = mask.clone()
    RequestGrammar(backend.compile("regex", EMAIL)).fill(mask, 1)
    assert torch.equal(mask[0], full[0]) and torch.equal(mask[2], full[2])
    assert not torch.equal(mask[1], full[1])
    allowed = reference_apply(torch.zeros(3, vocab_size), mask, [1])[1]
    letters = {tokenizer.convert_tokens_to_ids(c) for c in "abcxyz"}
    assert all(allowed[t] == 0 for t in letters)
    assert torch.isneginf(allowed[tokenizer.eos_token_id])


def test_random_valid_walk_terminates(backend: GrammarBackend, tokenizer: Any, vocab_size: int) -> None:
    """Tokens drawn at random among the allowed ones always make a string the regex matches."""
    compiled = backend.compile("regex", EMAIL)
    rng = random.Random(3)
    eos = tokenizer.eos_token_id
    for _ in range(5):
        grammar, taken = RequestGrammar(compiled), []
        while not grammar.terminated:
            choices = sorted(allowed_ids(grammar, vocab_size))
            token = eos if eos in choices and rng.random() < 0.5 else rng.choice(choices)
            assert grammar.accept(token)
            taken.append(token)
            assert len(taken) < 40
        assert re.fullmatch(EMAIL, tokenizer.decode(taken, skip_special_tokens=True))


def _accepts_after_prefix(backend: GrammarBackend, tokenizer: Any, schema: dict[str, Any], token: int) -> bool:
    grammar = RequestGrammar(backend.compile("json_schema", json.dumps(schema)))
    for t in tokenizer.encode('{"name": "a', add_special_tokens=False):
        assert grammar.accept(t)
    return grammar.accept(token)


CONTROL_CHARS = ["\t", "\x0e", "\x1f"]


@pytest.mark.parametrize("char", CONTROL_CHARS, ids=repr)
@pytest.mark.parametrize(
    "string", [{"type": "string"}, {"type": "string", "pattern": "^.{1,8}$"}], ids=["unbounded", "pattern"]
)
def test_json_string_refuses_control_characters(
    backend: GrammarBackend, tokenizer: Any, char: str, string: dict[str, Any]
) -> None:
    """JSON (RFC 8259) strings cannot hold raw U+0000-U+001F: the grammar must refuse the token."""
    (token,) = tokenizer.encode(char, add_special_tokens=False)
    schema = {"type": "object", "properties": {"name": string}, "required": ["name"]}
    assert not _accepts_after_prefix(backend, tokenizer, schema, token)
    (letter,) = tokenizer.encode("b", add_special_tokens=False)
    assert _accepts_after_prefix(backend, tokenizer, schema, letter)


@pytest.mark.parametrize("char", CONTROL_CHARS, ids=repr)
def test_length_bounded_json_string_refuses_control_characters(
    backend: GrammarBackend, tokenizer: Any, char: str
) -> None:
    """xgrammar 0.2.8 alone compiles a minLength/maxLength string to [^"\\\r\n]{m,n}, which admits raw
    control characters (mlc-ai/xgrammar#800); ``bounded_strings`` gives such strings a pattern
    over the characters JSON allows raw."""
    (token,) = tokenizer.encode(char, add_special_tokens=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    assert not _accepts_after_prefix(backend, tokenizer, schema, token)


def test_bounded_strings_rewrites_only_length_bounded_string_schemas() -> None:
    """Subschemas anywhere (a property called "default" included) get the pattern; data keywords,
    strings with a pattern or format of their own, and unbounded strings keep theirs."""
    from runtime.text.grammar.backend import bounded_strings

    schema = {
        "type": "object",
        "properties": {
            "default": {"type": "string", "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}},
            "code": {"type": "string", "maxLength": 4, "pattern": "^[A-Z]+$"},
            "free": {"type": "string"},
        },
        "default": {"type": "string", "maxLength": 1},
    }
    out = bounded_strings(schema)
    assert out["properties"]["default"]["pattern"].endswith("{0,5}$")
    assert out["properties"]["tags"]["items"]["pattern"].endswith("{1,3}$")
    assert out["properties"]["code"]["pattern"] == "^[A-Z]+$"
    assert "pattern" not in out["properties"]["free"] and out["default"] == schema["default"]
    assert schema["properties"]["default"] == {"type": "string", "maxLength": 5}  # the input is not modified
