"""The text workloads (chat messages, not token ids; served only): ``json-schema`` (extract a record
as JSON under its schema) and ``repeat`` (answers that quote their prompt, speculative decoding's
copy-heavy case). ``bench.workloads`` registers them with the token-id workloads."""

from __future__ import annotations

import json
import random
from typing import Any

from bench.workload_base import DEFAULT_VOCAB_HIGH, DEFAULT_VOCAB_LOW, BenchRequest, Workload, _check_range

# ---------------------------------------------------------------------- json-schema


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _str(max_len: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_len}


# Extraction-style schemas: every string, array and number is bounded, so a greedy output
# always closes and ends with stop (a free string can run to max_new_tokens on a small model).
JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj(
        name=_str(40), age={"type": "integer", "minimum": 0, "maximum": 120}, city=_str(40), occupation=_str(40)
    ),
    "order": _obj(
        customer=_str(40),
        currency={"enum": ["USD", "EUR", "GBP"]},
        items={
            "type": "array",
            "maxItems": 4,
            "items": _obj(product=_str(30), quantity={"type": "integer", "minimum": 1, "maximum": 99}),
        },
    ),
    "event": _obj(
        title=_str(60),
        date={"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        category={"enum": ["conference", "meetup", "workshop", "webinar"]},
        attendees={"type": "integer", "minimum": 0, "maximum": 10000},
        online={"type": "boolean"},
    ),
    "review": _obj(
        product=_str(40),
        rating={"type": "integer", "minimum": 1, "maximum": 5},
        sentiment={"enum": ["positive", "neutral", "negative"]},
        pros={"type": "array", "maxItems": 3, "items": _str(30)},
    ),
    "ticket": _obj(
        customer=_str(40),
        subject=_str(60),
        priority={"enum": ["low", "medium", "high", "urgent"]},
        department={"enum": ["billing", "shipping", "technical", "account"]},
    ),
}

_SYSTEM = "You are a data extraction assistant. Reply with one JSON object and nothing else."
_FIRST = ["Maria", "James", "Aiko", "Omar", "Elena", "Lucas", "Priya", "Jonas", "Fatima", "Chen"]
_LAST = ["Lopez", "Smith", "Tanaka", "Haddad", "Rossi", "Martin", "Patel", "Berg", "Diallo", "Wang"]
_CITY = ["Valencia", "Chicago", "Osaka", "Beirut", "Turin", "Lyon", "Pune", "Oslo", "Dakar", "Chengdu"]
_JOB = ["nurse", "teacher", "software engineer", "chef", "architect", "pilot", "accountant", "farmer"]
_PRODUCT = ["coffee grinder", "desk lamp", "running shoes", "phone case", "backpack", "kettle", "monitor"]


def _document(kind: str, rng: random.Random) -> str:
    """A short text that holds one record of ``kind`` (names, numbers and places drawn from ``rng``)."""
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    city, product = rng.choice(_CITY), rng.choice(_PRODUCT)
    if kind == "person":
        return f"{name}, {rng.randint(19, 80)}, lives in {city} and works as a {rng.choice(_JOB)}."
    if kind == "order":
        lines = ", ".join(f"{rng.randint(1, 5)} x {p}" for p in rng.sample(_PRODUCT, rng.randint(1, 3)))
        return f"Order from {name}: {lines}. Total charged in {rng.choice(['dollars', 'euros', 'pounds'])}."
    if kind == "event":
        return (
            f"The {city} {rng.choice(['Python', 'Data', 'Design', 'Cloud'])} "
            f"{rng.choice(['meetup', 'conference', 'workshop'])} takes place on 2025-{rng.randint(1, 12):02d}-"
            f"{rng.randint(1, 28):02d}; about {rng.randint(20, 900)} people are expected to attend in person."
        )
    if kind == "review":
        return (
            f"Review by {name}: I bought the {product} last month. {rng.choice(['Solid', 'Cheap', 'Great'])} "
            f"build and {rng.choice(['easy to use', 'quiet', 'light'])}, but the "
            f"{rng.choice(['cable', 'lid', 'strap'])} feels flimsy. Rating: {rng.randint(1, 5)}/5."
        )
    return (
        f"Hello, this is {name}. My {product} arrived {rng.choice(['broken', 'late', 'without a charger'])} "
        f"and I was charged twice. Please help {rng.choice(['soon', 'today', 'when you can'])}."
    )


def json_schema(
    num_requests: int = 64,
    max_new_tokens: int = 256,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    """Chat extraction requests cycling through ``JSON_SCHEMAS``, each on its own generated text.

    ``max_new_tokens`` is a cap the bounded schemas stay well under (outputs end with stop).
    The token range is taken (every workload takes it) but unused: the prompts are text.
    """
    _check_range(vocab_low, vocab_high)
    rng = random.Random(f"json-schema-{seed}")
    kinds = list(JSON_SCHEMAS)
    reqs = []
    for i in range(num_requests):
        kind = kinds[i % len(kinds)]
        schema = JSON_SCHEMAS[kind]
        ask = (
            f"Extract the {kind} from the text below as JSON with the fields "
            f"{', '.join(schema['properties'])}.\n\nText: {_document(kind, rng)}"
        )
        reqs.append(
            BenchRequest(
                i,
                [],
                max_new_tokens,
                session=i,
                json_schema=json.dumps(schema),
                messages=[{"role": "system", "content": _SYSTEM}, {"role": "user", "content": ask}],
            )
        )
    return Workload(
        "json-schema",
        dict(
            num_requests=num_requests,
            max_new_tokens=max_new_tokens,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        reqs,
    )


_WORDS = (
    "river",
    "garden",
    "market",
    "engine",
    "winter",
    "letter",
    "window",
    "forest",
    "silver",
    "harbor",
    "teacher",
    "bridge",
    "candle",
    "mountain",
    "station",
    "village",
    "island",
    "museum",
    "orchard",
    "tower",
)
_VERBS = ("opened", "carried", "painted", "found", "watched", "followed", "repaired", "described", "visited")


def _passage(rng: random.Random, sentences: int) -> str:
    """A few plain sentences built from ``rng`` (every run of a seed gets the same text)."""
    out = []
    for _ in range(sentences):
        a, b, c = rng.sample(_WORDS, 3)
        out.append(
            f"The {a} near the {b} was {rng.choice(_VERBS)} by a {c} every {rng.choice(['morning', 'evening'])}."
        )
    return " ".join(out)


def _function(rng: random.Random) -> tuple[str, str]:
    """A short Python function, and one of its variable names."""
    name, var, other = rng.sample(["total", "count", "value", "items", "result", "offset", "limit", "scale"], 3)
    factor = rng.randint(2, 9)
    code = (
        f"def compute_{name}(data, {other}):\n    {var} = 0\n    for x in data:\n        if x > {other}:\n"
        f"            {var} += x * {factor}\n        else:\n            {var} -= x\n    return {var}\n"
    )
    return code, var


def repeat(
    num_requests: int = 16,
    max_new_tokens: int = 160,
    sentences: int = 4,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    """Chat requests whose answers quote their prompt, alternately a text rewrite with one word
    changed and a function with one variable renamed (speculative decoding's copy-heavy case).
    The token range is taken (every workload takes it) but unused: the prompts are text."""
    _check_range(vocab_low, vocab_high)
    rng = random.Random(f"repeat-{seed}")
    reqs = []
    for i in range(num_requests):
        if i % 2 == 0:
            text = _passage(rng, sentences)
            old = rng.choice([w for w in _WORDS if w in text])
            new = rng.choice([w for w in _WORDS if w not in text])
            ask = (
                f'Rewrite the text below exactly as it is, but with the word "{old}" replaced by '
                f'"{new}". Reply with the rewritten text only.\n\n{text}'
            )
        else:
            code, var = _function(rng)
            ask = (
                f"Rename the variable `{var}` to `acc` in this Python function. Reply with the whole "
                f"function only.\n\n```python\n{code}```"
            )
        reqs.append(
            BenchRequest(i, [], max_new_tokens, session=i, messages=[{"role": "user", "content": ask}], until_eos=True)
        )
    return Workload(
        "repeat",
        dict(
            num_requests=num_requests,
            max_new_tokens=max_new_tokens,
            sentences=sentences,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        reqs,
    )
