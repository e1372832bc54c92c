"""Structured outputs end to end on the default model, SmolLM2-135M-Instruct (CPU, fp32).

Random logits can show that a grammar's mask is applied; only a trained model fed through
every front door shows that what comes out is what was asked for, and ends when it should (a
small model left to run fills max_tokens, and truncated JSON is no JSON). One concurrent wave
(module fixture ``wave``) goes through the openai SDK (chat and completions, greedy and
sampled, streamed or not, n=2), SGLang's ``/generate`` and the ZMQ client, each constrained
by a JSON schema (made from templates: nested objects, arrays with maxItems, enums, bounded
integers and numbers, optional fields, additionalProperties false), ``json_object``, a regex,
an EBNF grammar or a pydantic model; the tests then check each kind of answer:

* every JSON output parses and validates against its schema, and finishes with ``stop``
  (a request cut at max_tokens would leave truncated JSON: every schema bounds its output);
* the same greedy or seeded request gives the same text through every door (streamed or not,
  HTTP or ZMQ, n=1 or the first sample of n=2, the schema as an object or as text);
* regex outputs match in full; EBNF outputs parse (arithmetic, a yes/no list);
* ``beta.chat.completions.parse(response_format=PydanticModel)`` returns the parsed object.

Then, one at a time: a grammar complete before min_new_tokens ends its request with stop;
constraints that do not parse and two constraints at once are refused
(HTTP 400 naming the parameter, the ZMQ client's ``RequestError``) and the server goes on
serving; constrained requests aborted mid-stream (HTTP disconnect, a ZMQ stream left early,
``abort(rid)``, one aborted while its grammar may still compile) leave the KV pool whole; and
unconstrained greedy requests decoded in the same batches as constrained ones give the tokens
they give alone (the grammar mask touches only its own rows); and last, a grammar whose forced
text starts inside a multi-byte character (emoji the vocabulary splits) neither stops the
server nor breaks the output.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from runtime.client import RequestError
from tests.support.real_model import API_KEY, CLIENT_TIMEOUT_S, SERVED_NAME
from tests.support.server_fixtures import assert_idle_and_nothing_leaked, is_idle, wait_until
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.real_model"]

SCHEMA_TOKENS = 160  # every schema below bounds its output well inside this
SHORT_TOKENS = 48  # regex / EBNF answers
SAMPLED = {"temperature": 0.8}


# ---------------------------------------------------------------------- clients


@pytest.fixture(scope="module")
def oai(smollm2_server: ServedClient) -> Iterator[openai.OpenAI]:
    assert smollm2_server.server.http_address is not None
    client = openai.OpenAI(
        base_url=smollm2_server.server.http_address + "/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    try:
        yield client
    finally:
        client.close()


def post(server: ServedClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """``(status, JSON body)`` of a POST to the server's HTTP address."""
    assert server.server.http_address is not None
    req = urllib.request.Request(
        server.server.http_address + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@dataclass
class Sample:
    """One output of one request, whichever door it came through."""

    text: str
    finish: str  # "stop", "length", "abort"


def chat(
    oai: openai.OpenAI,
    content: str,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    n: int = 1,
    stream: bool = False,
    response_format: dict[str, Any] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> list[Sample]:
    kwargs: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "n": n,
    }
    if seed is not None:
        kwargs["seed"] = seed
    if response_format is not None:
        kwargs["response_format"] = response_format
    if extra_body is not None:
        kwargs["extra_body"] = extra_body
    if not stream:
        r = oai.chat.completions.create(**kwargs)
        assert len(r.choices) == n
        return [Sample(c.message.content or "", c.finish_reason) for c in sorted(r.choices, key=lambda c: c.index)]
    texts, finishes = [""] * n, [""] * n
    for event in oai.chat.completions.create(**kwargs, stream=True):
        for choice in event.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    return [Sample(t, f) for t, f in zip(texts, finishes)]


def completion(
    oai: openai.OpenAI,
    prompt: str,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    extra_body: dict[str, Any],
) -> list[Sample]:
    r = oai.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        extra_body=extra_body,
    )
    return [Sample(c.text, c.finish_reason) for c in r.choices]


def native(server: ServedClient, text: str, sampling_params: dict[str, Any]) -> list[Sample]:
    """SGLang's /generate over HTTP."""
    status, body = post(server, "/generate", {"text": text, "sampling_params": sampling_params})
    assert status == 200, body
    return [Sample(body["text"], body["meta_info"]["finish_reason"]["type"])]


def zmq(server: ServedClient, content: str, sampling_params: dict[str, Any]) -> list[Sample]:
    r = server.generate(messages=[{"role": "user", "content": content}], sampling_params=sampling_params)
    results = r if isinstance(r, list) else [r]
    return [Sample(x["text"], x["meta"]["finish_reason"]["type"]) for x in results]


# ---------------------------------------------------------------------- the schemas


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _string(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _integer(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


# Each template: variant i -> (schema, chat prompt, completion prompt).
Template = Callable[[int], tuple[dict[str, Any], str, str]]
JOBS = ["teacher", "pilot", "chef", "doctor"]
ANIMALS = [["dog", "cat", "horse"], ["eagle", "owl", "parrot", "swan"]]
CITIES = ["Paris", "Tokyo", "Cairo", "Lima"]


def person(i: int) -> tuple[dict[str, Any], str, str]:
    job = JOBS[i]
    return (
        _object({"name": _string(12 + 4 * i), "age": _integer(18, 60 + 10 * i)}),
        f"Describe a fictional {job} as JSON with a name and an age.",
        f"A fictional {job}, as JSON: ",
    )


def choice(i: int) -> tuple[dict[str, Any], str, str]:
    animals = ANIMALS[i]
    return (
        _object({"animal": {"enum": animals}, "size": {"type": "string", "enum": ["small", "medium", "large"]}}),
        f"Pick one of these animals: {', '.join(animals)}, and say how big it is, as JSON.",
        "An animal and its size, as JSON: ",
    )


def tags(i: int) -> tuple[dict[str, Any], str, str]:
    topic = ["the ocean", "music"][i]
    return (
        _object(
            {"topic": _string(16), "tags": {"type": "array", "items": _string(10), "minItems": 1, "maxItems": 2 + i}}
        ),
        f"Give a short topic name and a few one-word tags about {topic}, as JSON.",
        f"Tags about {topic}, as JSON: ",
    )


def review(i: int) -> tuple[dict[str, Any], str, str]:
    rating = {"type": "number", "minimum": 0, "maximum": 5} if i == 0 else _integer(1, 5)
    kind = ["book", "film"][i]
    return (
        _object({kind: _object({"title": _string(24), "year": _integer(1900, 2024)}), "rating": rating}),
        f"Review a famous {kind} as JSON: its title and year, and a rating.",
        f"A {kind} review, as JSON: ",
    )


def place(i: int) -> tuple[dict[str, Any], str, str]:
    city = CITIES[i]
    required = [["city"], ["city", "country"]][i]
    return (
        _object({"city": _string(16), "country": _string(16), "population": _integer(0, 40_000_000)}, required),
        f"Tell me about {city} as JSON.",
        f"{city}, as JSON: ",
    )


def scores(i: int) -> tuple[dict[str, Any], str, str]:
    return (
        _object(
            {"passed": {"type": "boolean"}, "scores": {"type": "array", "items": _integer(0, 10), "maxItems": 3 + i}}
        ),
        "A student took some tests scored out of 10. Report the scores and whether they passed, as JSON.",
        "Test scores, as JSON: ",
    )


def people(i: int) -> tuple[dict[str, Any], str, str]:
    return (
        _object(
            {
                "people": {
                    "type": "array",
                    "maxItems": 2,
                    "items": _object({"name": _string(10), "age": _integer(0, 99)}),
                }
            }
        ),
        f"List {['two friends', 'a mother and her son'][i]} with their names and ages, as JSON.",
        "Two people, as JSON: ",
    )


def answer(i: int) -> tuple[dict[str, Any], str, str]:
    question = ["Is the sun a star?", "Can fish fly?"][i]
    return (
        _object(
            {
                "answer": {"enum": ["yes", "no"]},
                "confidence": {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
            },
            ["answer"] if i else None,
        ),
        f"{question} Answer as JSON with your confidence in percent.",
        f"Q: {question} A (JSON): ",
    )


TEMPLATES: list[Template] = [person, choice, tags, review, place, scores, people, answer]
# Two variants of each template but the two with the longest answers: 14 schemas.
SCHEMAS = [
    (template.__name__, *template(i)) for template in TEMPLATES for i in range(1 if template in (review, people) else 2)
]


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


Run = Callable[[], list[Sample]]


@dataclass
class SchemaJob:
    """One schema request of the wave; ``run`` returns its samples. Requests of one schema and
    one ``family`` are the same request through different doors: their first samples must agree."""

    key: str
    schema: dict[str, Any]
    family: tuple[int, str]  # (schema index, "chat greedy" | "chat seeded" | "raw greedy")
    run: Callable[[], list[Sample]]
    n: int = 1


def schema_jobs(oai: openai.OpenAI, server: ServedClient) -> list[SchemaJob]:
    """Each schema through four of these nine ways, in turn: 56 requests, 68 outputs."""

    def ways(k: int, schema: dict[str, Any], prompt: str, raw: str) -> list[tuple[str, str, Run, int]]:
        """(way, family, run, n); a seeded request's first sample keeps its seed when n > 1."""
        rf = response_format(f"schema_{k}", schema)
        seed = 1000 + k
        return [
            ("chat", "chat greedy", lambda: chat(oai, prompt, max_tokens=SCHEMA_TOKENS, response_format=rf), 1),
            (
                "chat",
                "chat seeded",
                lambda: chat(oai, prompt, max_tokens=SCHEMA_TOKENS, seed=seed, response_format=rf, **SAMPLED),
                1,
            ),
            (
                "chat stream",
                "chat greedy",
                lambda: chat(oai, prompt, max_tokens=SCHEMA_TOKENS, stream=True, response_format=rf),
                1,
            ),
            (
                "chat stream n=2",
                "chat seeded",
                lambda: chat(
                    oai, prompt, max_tokens=SCHEMA_TOKENS, seed=seed, n=2, stream=True, response_format=rf, **SAMPLED
                ),
                2,
            ),
            (
                "chat n=2",
                "chat seeded",
                lambda: chat(oai, prompt, max_tokens=SCHEMA_TOKENS, seed=seed, n=2, response_format=rf, **SAMPLED),
                2,
            ),
            (
                "completion",
                "raw greedy",
                lambda: completion(oai, raw, max_tokens=SCHEMA_TOKENS, extra_body={"response_format": rf}),
                1,
            ),
            (
                "/generate, schema object",
                "raw greedy",
                lambda: native(server, raw, {"json_schema": schema, "max_new_tokens": SCHEMA_TOKENS, "temperature": 0}),
                1,
            ),
            (
                "zmq, schema text",
                "chat seeded",
                lambda: zmq(
                    server,
                    prompt,
                    {"json_schema": json.dumps(schema), "max_new_tokens": SCHEMA_TOKENS, "seed": seed, **SAMPLED},
                ),
                1,
            ),
            (
                "zmq, schema object",
                "chat greedy",
                lambda: zmq(server, prompt, {"json_schema": schema, "max_new_tokens": SCHEMA_TOKENS, "temperature": 0}),
                1,
            ),
        ]

    jobs = []
    for k, (template, schema, prompt, raw) in enumerate(SCHEMAS):
        options = ways(k, schema, prompt, raw)
        for j in range(4):
            way, family, run, n = options[(4 * k + j) % len(options)]
            jobs.append(SchemaJob(f"schema {k} ({template}), {family}, via {way}", schema, (k, family), run, n))
    return jobs


# ---------------------------------------------------------------------- regex, EBNF, pydantic

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z]{1,12}(\.[a-z]{1,12})?@[a-z]{2,12}\.(com|org|net)"
CLOCK = r"([01]\d|2[0-3]):[0-5]\d"
REGEX_CASES: list[tuple[str, str]] = [  # (regex, chat prompt)
    (PHONE, "What is a phone number for a pizza shop in New York?"),
    (DATE, "On what date did people first land on the moon?"),
    (EMAIL, "Make up an email address for a person called John Smith."),
    (CLOCK, "What time does a bakery usually open in the morning?"),
]

ARITHMETIC = r"""
root ::= expr
expr ::= term (" " ("+" | "-") " " term){0,3}
term ::= num (" * " num){0,1}
num ::= [1-9] [0-9]{0,2}
"""
YES_NO = r"""
root ::= answer (", " answer){0,4}
answer ::= "yes" | "no"
"""
EBNF_CASES: list[tuple[str, str, str]] = [  # (name, grammar, chat prompt)
    ("arithmetic", ARITHMETIC, "Write an arithmetic expression that adds two numbers."),
    ("arithmetic", ARITHMETIC, "Write a sum of three numbers, like 2 + 3 + 4."),
    ("yes/no", YES_NO, "Answer each with yes or no: Is fire hot? Is ice hot? Is water wet?"),
    ("yes/no", YES_NO, "Are cats mammals? Are fish birds?"),
]


def evaluate_arithmetic(text: str) -> int:
    """The value of an output of ARITHMETIC, parsed here without eval (ValueError if it does not parse)."""
    tokens = text.split(" ")
    if len(tokens) % 2 == 0:
        raise ValueError(f"{text!r}: an even number of tokens")

    def number(s: str) -> int:
        if not re.fullmatch(r"[1-9][0-9]{0,2}", s):
            raise ValueError(f"{text!r}: {s!r} is not a number of the grammar")
        return int(s)

    total, sign, term, terms = 0, 1, number(tokens[0]), 1
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            term *= number(operand)
        elif op in "+-":
            total, sign, term, terms = total + sign * term, 1 if op == "+" else -1, number(operand), terms + 1
        else:
            raise ValueError(f"{text!r}: {op!r} is not an operator")
    if terms > 4:
        raise ValueError(f"{text!r}: more than four terms")
    return total + sign * term


class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: Literal["dog", "cat", "bird", "fish"]
    age: int = Field(ge=0, le=30)


class Item(BaseModel):
    product: str = Field(max_length=16)
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    customer: str = Field(max_length=16)
    items: list[Item] = Field(max_length=2)
    paid: bool


PYDANTIC_CASES: list[tuple[type[BaseModel], str]] = [
    (Pet, "Describe a pet: its name, species and age."),
    (Order, "Write a small grocery order for a customer called Ann."),
]


def parse_pydantic(oai: openai.OpenAI, model: type[BaseModel], content: str) -> Any:
    return oai.beta.chat.completions.parse(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": content}],
        response_format=model,
        temperature=0,
        max_tokens=SCHEMA_TOKENS,
    )


# ---------------------------------------------------------------------- the wave


JSON_OBJECT_CASES: list[tuple[str, dict[str, Any]]] = [  # (prompt, sampling)
    ('Return a JSON object with the keys "name" and "age" for a person named Tom who is 30.', {}),
    ('Return a JSON object with the key "capital" for France.', {}),
    ('Give a JSON object with the fields "city" and "country" for Paris.', {"seed": 7, **SAMPLED}),
]


@dataclass
class Wave:
    schema: list[tuple[SchemaJob, Future[list[Sample]]]]
    json_object: list[Future[list[Sample]]]
    regex: list[tuple[str, str, Future[list[Sample]]]]  # (route, regex, result)
    ebnf: list[tuple[str, str, Future[list[Sample]]]]  # (name, route, result)
    pydantic: list[tuple[type[BaseModel], Future[Any]]]
    seconds: float


@pytest.fixture(scope="module")
def wave(smollm2_server: ServedClient, oai: openai.OpenAI) -> Iterator[Wave]:
    """Every request of the checks below, all sent at once (73 requests, one batch on the CPU)."""
    jobs = schema_jobs(oai, smollm2_server)
    n_requests = len(jobs) + len(JSON_OBJECT_CASES) + 2 * len(REGEX_CASES) + len(EBNF_CASES) + len(PYDANTIC_CASES)
    start = time.monotonic()
    with ThreadPoolExecutor(n_requests) as pool:
        schema = [(job, pool.submit(job.run)) for job in jobs]
        json_object = [
            pool.submit(
                chat, oai, prompt, max_tokens=100, response_format={"type": "json_object"}, stream=i == 2, **sampling
            )
            for i, (prompt, sampling) in enumerate(JSON_OBJECT_CASES)
        ]
        regex = []
        for i, (pattern, prompt) in enumerate(REGEX_CASES):
            regex.append(
                (
                    "chat" if i % 2 else "chat stream",
                    pattern,
                    pool.submit(
                        chat,
                        oai,
                        prompt,
                        max_tokens=SHORT_TOKENS,
                        stream=i % 2 == 0,
                        extra_body={"regex": pattern},
                        **(SAMPLED | {"seed": i} if i == 1 else {}),
                    ),
                )
            )
            if i % 2:
                regex.append(
                    (
                        "completion",
                        pattern,
                        pool.submit(
                            completion,
                            oai,
                            f"{prompt}\nAnswer: ",
                            max_tokens=SHORT_TOKENS,
                            extra_body={"regex": pattern},
                        ),
                    )
                )
            else:
                regex.append(
                    (
                        "zmq",
                        pattern,
                        pool.submit(
                            zmq,
                            smollm2_server,
                            prompt,
                            {"regex": pattern, "max_new_tokens": SHORT_TOKENS, "temperature": 0},
                        ),
                    )
                )
        ebnf = []
        for i, (name, grammar, prompt) in enumerate(EBNF_CASES):
            if i % 2:
                ebnf.append(
                    (
                        name,
                        "/generate",
                        pool.submit(
                            native,
                            smollm2_server,
                            f"{prompt}\nAnswer: ",
                            {"ebnf": grammar, "max_new_tokens": SHORT_TOKENS, "temperature": 0},
                        ),
                    )
                )
            else:
                ebnf.append(
                    (
                        name,
                        "chat",
                        pool.submit(chat, oai, prompt, max_tokens=SHORT_TOKENS, extra_body={"ebnf": grammar}),
                    )
                )
        pydantic = [(model, pool.submit(parse_pydantic, oai, model, prompt)) for model, prompt in PYDANTIC_CASES]
        for future in [f for _, f in schema] + json_object + [f for *_, f in regex + ebnf] + [f for _, f in pydantic]:
            future.exception()  # wait for all (a failure is the owning test's to report)
    yield Wave(schema, json_object, regex, ebnf, pydantic, time.monotonic() - start)


# ---------------------------------------------------------------------- JSON schemas


def test_every_schema_output_parses_and_validates(wave: Wave, smollm2_server: ServedClient) -> None:
    """56 schema requests (68 outputs) through nine ways, all at once: 100% valid JSON."""
    assert len(wave.schema) >= 50 and len(SCHEMAS) == 14
    outputs = 0
    bad = []
    for job, future in wave.schema:
        samples = future.result()
        assert len(samples) == job.n, job.key
        for sample in samples:
            outputs += 1
            try:
                assert sample.finish == "stop", f"finish_reason {sample.finish}"
                jsonschema.validate(json.loads(sample.text), job.schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                bad.append(f"{job.key}: {sample.text!r}: {str(exc).splitlines()[0]}")
    assert not bad, "\n".join(bad)
    assert outputs >= 60
    assert_idle_and_nothing_leaked(smollm2_server)


def test_the_same_request_gives_the_same_text_through_every_door(wave: Wave) -> None:
    """A schema's greedy requests, and its seeded ones (a seeded row's noise depends on its seed
    and step only), agree whichever way they came: streamed or not, HTTP or ZMQ, n=1 or the
    first sample of n=2, the schema as an object or as text."""
    families: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for job, future in wave.schema:
        families.setdefault(job.family, []).append((job.key, future.result()[0].text))
    compared = [members for members in families.values() if len(members) > 1]
    assert len(compared) >= 10
    for members in compared:
        assert len({text for _, text in members}) == 1, members


def test_json_object_gives_an_object(wave: Wave) -> None:
    for (prompt, _), future in zip(JSON_OBJECT_CASES, wave.json_object):
        [sample] = future.result()
        assert sample.finish == "stop", (prompt, sample)
        assert isinstance(json.loads(sample.text), dict), (prompt, sample)


# ---------------------------------------------------------------------- regex, EBNF, pydantic


def test_regex_outputs_match_in_full(wave: Wave) -> None:
    assert len(wave.regex) == 2 * len(REGEX_CASES)
    for route, pattern, future in wave.regex:
        [sample] = future.result()
        assert sample.finish == "stop", (route, pattern, sample)
        assert re.fullmatch(pattern, sample.text), (route, pattern, sample)


def test_ebnf_outputs_parse(wave: Wave) -> None:
    for name, route, future in wave.ebnf:
        [sample] = future.result()
        assert sample.finish == "stop", (name, route, sample)
        if name == "arithmetic":
            evaluate_arithmetic(sample.text)
        else:
            answers = sample.text.split(", ")
            assert 1 <= len(answers) <= 5 and set(answers) <= {"yes", "no"}, (route, sample)


def test_arithmetic_checker_refuses_what_the_grammar_does() -> None:
    """The EBNF check above can fail: it refuses text outside ARITHMETIC."""
    assert evaluate_arithmetic("2 + 3 * 4 - 5") == 9
    for text in ("2 +", "2 / 3", "0 + 1", "1 + 2 + 3 + 4 + 5", "2  + 3", "1234"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(text)


def test_pydantic_parse_returns_the_model(wave: Wave) -> None:
    for model, future in wave.pydantic:
        r = future.result()
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", message.content
        assert message.refusal is None
        assert isinstance(message.parsed, model), message.content
        assert message.parsed == model.model_validate_json(message.content or "")


def test_a_complete_grammar_ends_the_request_before_min_tokens(
    smollm2_server: ServedClient, oai: openai.OpenAI
) -> None:
    """min_new_tokens suppresses EOS, but once the grammar's output is complete EOS is the only
    token it allows: the request stops there (it used to sample a token outside the grammar,
    greedy token 0, and end with an abort)."""
    prompt = "Is the sky blue? Answer yes or no."
    answers = r"(yes|no)(, (yes|no)){0,3}"  # EOS allowed after each answer
    with ThreadPoolExecutor(3) as pool:
        greedy = pool.submit(
            zmq,
            smollm2_server,
            prompt,
            {"regex": "yes|no", "min_new_tokens": 6, "max_new_tokens": 12, "temperature": 0},
        )
        sampled = pool.submit(
            chat, oai, prompt, max_tokens=12, seed=4, extra_body={"regex": "yes|no", "min_tokens": 6}, **SAMPLED
        )
        # Where the grammar still allows more than EOS, min_new_tokens holds: no early stop.
        longer = pool.submit(
            zmq, smollm2_server, prompt, {"regex": answers, "min_new_tokens": 5, "max_new_tokens": 24, "temperature": 0}
        )
        for future in (greedy, sampled):
            [sample] = future.result()
            assert sample.finish == "stop" and sample.text in ("yes", "no"), sample
        [sample] = longer.result()
        assert sample.finish == "stop" and re.fullmatch(answers, sample.text), sample
        assert sample.text.count(",") >= 2, sample  # 5 tokens: "no", ",", " no", ",", " no" at least


# ---------------------------------------------------------------------- refused constraints


BAD: list[tuple[str, dict[str, Any], str]] = [  # (what, sampling params, the parameter named)
    ("a schema of an unknown type", {"json_schema": {"type": "bogus"}}, "json_schema"),
    ("a schema that is not JSON", {"json_schema": "{not json"}, "json_schema"),
    ("an unclosed regex group", {"regex": "(ab"}, "regex"),
    ("an EBNF rule never defined", {"ebnf": "root ::= missing"}, "ebnf"),
    ("EBNF without a root", {"ebnf": 'start ::= "a"'}, "ebnf"),
    ("a regex and an EBNF grammar", {"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
    ("a schema and a regex", {"json_schema": {"type": "object"}, "regex": "a+"}, "regex"),
]


def openai_form(params: dict[str, Any]) -> dict[str, Any]:
    """The chat completion fields for these sampling params (a schema goes in response_format)."""
    body: dict[str, Any] = {k: v for k, v in params.items() if k != "json_schema"}
    if "json_schema" in params:
        schema = params["json_schema"]
        if not isinstance(schema, dict):  # response_format takes an object: send unparsable text via /generate only
            return {}
        body["response_format"] = response_format("bad", schema)
    return body


def test_bad_constraints_are_refused_naming_the_parameter(smollm2_server: ServedClient, oai: openai.OpenAI) -> None:
    before = wait_until(lambda: is_idle(smollm2_server), 60, "an idle server")
    refused = 0
    for what, params, param in BAD:
        with pytest.raises(RequestError) as zmq_error:  # the ZMQ client's typed error
            smollm2_server.generate("Hi", {"max_new_tokens": 4, **params})
        assert zmq_error.value.code == "invalid_request", what
        assert zmq_error.value.message.startswith(f"sampling_params.{param}: "), (what, zmq_error.value.message)

        status, body = post(
            smollm2_server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **params}}
        )
        assert status == 400 and body["error"]["param"] == param, (what, body)
        assert body["error"]["code"] == "invalid_request" and body["error"]["message"].startswith(f"{param}: ")

        fields = openai_form(params)
        if not fields:
            continue
        openai_param = "response_format" if param == "json_schema" else param
        rf = fields.pop("response_format", None)
        with pytest.raises(openai.BadRequestError) as http_error:
            chat(oai, "Hi", max_tokens=4, response_format=rf, extra_body=fields or None)
        error = http_error.value.body
        assert http_error.value.status_code == 400 and isinstance(error, dict), what
        assert error["param"] == openai_param, (what, error)
        assert error["message"].startswith(f"{openai_param}: "), (what, error)
        refused += 1
    assert refused == len(BAD) - 1
    with pytest.raises(openai.BadRequestError) as no_schema:  # json_schema without its schema
        chat(oai, "Hi", max_tokens=4, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert no_schema.value.body["param"] == "response_format"  # type: ignore[index]

    # Nothing reached the scheduler, and the server goes on serving, constrained requests too.
    after = assert_idle_and_nothing_leaked(smollm2_server)
    assert after["num_received"] == before["num_received"]
    [sample] = chat(
        oai, "On what date did people first land on the moon?", max_tokens=SHORT_TOKENS, extra_body={"regex": DATE}
    )
    assert sample.finish == "stop" and re.fullmatch(DATE, sample.text), sample
    assert zmq(smollm2_server, "Say hi.", {"max_new_tokens": 8, "temperature": 0})[0].text


# ---------------------------------------------------------------------- aborts


LONG_YES_NO = r"(yes|no)(, (yes|no)){150}"  # ~300 tokens: never done before its abort
LONG_SCHEMA = _object(
    {"answers": {"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 120, "maxItems": 120}}
)
LONG_TOKENS = 400


def test_constrained_requests_aborted_mid_stream_leave_the_pool_whole(
    smollm2_server: ServedClient, oai: openai.OpenAI
) -> None:
    """Five constrained requests aborted mid-generation: two HTTP streams closed after their
    first events, a ZMQ stream left early, a ZMQ stream aborted by rid, and a request aborted
    as soon as the tokenizer has it (its grammar, never seen before, may still be compiling).
    Each is aborted in the scheduler, and once idle the KV pool is whole."""
    before = wait_until(lambda: is_idle(smollm2_server), 60, "an idle server")
    prompt = "Answer yes or no to each of my next hundred questions."
    http_streams = [
        oai.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            max_tokens=LONG_TOKENS,
            temperature=0.8,
            seed=3,
            response_format=response_format("long", LONG_SCHEMA),
        ),
        oai.completions.create(
            model=SERVED_NAME, prompt=prompt, stream=True, max_tokens=LONG_TOKENS, extra_body={"regex": LONG_YES_NO}
        ),
    ]
    texts = []
    for stream in http_streams:
        text = ""
        for event in stream:
            choice = event.choices[0]
            assert choice.finish_reason is None
            text += (choice.delta.content if hasattr(choice, "delta") else choice.text) or ""
            if len(text) >= 16:
                break
        texts.append(text)
    assert texts[0].startswith('{"answers": ["'), texts[0]
    assert re.match(r"(yes|no), ", texts[1]), texts[1]

    zmq_stream = smollm2_server.generate(
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        sampling_params={"ebnf": YES_NO.replace("{0,4}", "{150}"), "max_new_tokens": LONG_TOKENS, "temperature": 0},
    )
    first = next(zmq_stream)
    assert not first["finished"] and first["text"] in ("yes", "no"), first

    rid = uuid.uuid4().hex
    by_rid = smollm2_server.generate(
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        rid=rid,
        sampling_params={"regex": LONG_YES_NO, "max_new_tokens": LONG_TOKENS, "seed": 5, **SAMPLED},
    )
    assert not next(by_rid)["finished"]
    for stream in http_streams:
        stream.close()  # the server sees the disconnect
    zmq_stream.close()  # a ZMQ stream left early is aborted
    assert smollm2_server.abort(rid) is True
    rest = list(by_rid)
    assert rest and rest[-1]["finished"] and rest[-1]["finish_reason"]["type"] == "abort", rest[-1:]

    # A grammar never compiled before, aborted as soon as the tokenizer holds the request.
    fresh = _object(
        {
            "word": _string(150 + uuid.uuid4().int % 50),
            "list": {  # ~1 s to compile
                "type": "array",
                "items": {"enum": ["yes", "no"]},
                "minItems": 120,
                "maxItems": 120,
            },
        }
    )
    rid = uuid.uuid4().hex
    wait_until(lambda: is_idle(smollm2_server), 60, "the aborts above to land")  # then only this one is active
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(
            smollm2_server.generate,
            messages=[{"role": "user", "content": prompt}],
            rid=rid,
            sampling_params={"json_schema": fresh, "max_new_tokens": LONG_TOKENS},
        )
        wait_until(
            lambda: smollm2_server.server_info()["tokenizer"]["active_requests"] == 1,
            60,
            "the tokenizer to hold the request",
        )
        assert smollm2_server.abort(rid) is True
        assert result.result()["meta"]["finish_reason"]["type"] == "abort"

    after = assert_idle_and_nothing_leaked(smollm2_server)
    assert after["num_aborted"] == before["num_aborted"] + 5, (before["num_aborted"], after["num_aborted"])
    [sample] = chat(
        oai,
        "What time does a bakery usually open in the morning?",
        max_tokens=SHORT_TOKENS,
        stream=True,
        extra_body={"regex": CLOCK},
    )
    assert sample.finish == "stop" and re.fullmatch(CLOCK, sample.text), sample


# ---------------------------------------------------------------------- unconstrained neighbours


FREE = ["What is the capital of Japan?", "What is 10 + 10?", "Who is the author of Hamlet?"]
FREE_TOKENS = 16
MEDIUM_SCHEMA = _object(
    {"answers": {"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 20, "maxItems": 20}}
)


def test_free_requests_beside_constrained_ones_decode_as_alone(
    smollm2_server: ServedClient, oai: openai.OpenAI
) -> None:
    """Greedy unconstrained requests decoded in the same batches as constrained ones (whose
    rows the grammar masks) give the tokens they give alone."""
    messages = [[{"role": "user", "content": q}] for q in FREE]
    greedy = {"max_new_tokens": FREE_TOKENS, "temperature": 0}
    wait_until(lambda: is_idle(smollm2_server), 60, "an idle server")
    alone = smollm2_server.generate(messages=messages, sampling_params=greedy)
    assert "Tokyo" in alone[0]["text"], alone[0]  # the model is itself

    # Constrained streams that outlast the free requests, each running before those are sent.
    constrained = [
        {"regex": r"(yes|no)(, (yes|no)){24}", "seed": 11, **SAMPLED},
        {"json_schema": MEDIUM_SCHEMA, "seed": 12, **SAMPLED},
        {"ebnf": YES_NO.replace("{0,4}", "{24}"), "temperature": 0},
    ]
    started = [threading.Event() for _ in constrained]
    finished_at: list[float] = [0.0] * len(constrained)

    def run(i: int) -> str:
        text = ""
        for chunk in smollm2_server.generate(
            messages=[{"role": "user", "content": "Answer yes or no, many times."}],
            stream=True,
            sampling_params={**constrained[i], "max_new_tokens": LONG_TOKENS},
        ):
            text += chunk["text"]
            started[i].set()
            if chunk["finished"]:
                assert chunk["finish_reason"]["type"] == "stop", chunk
                finished_at[i] = time.monotonic()
        return text

    with ThreadPoolExecutor(len(constrained) + len(FREE)) as pool:
        streams = [pool.submit(run, i) for i in range(len(constrained))]
        for i, event in enumerate(started):
            while not event.wait(1):
                if streams[i].done():  # a stream that failed before its first chunk fails here
                    streams[i].result()
                    raise AssertionError(f"constrained stream {i} ended without a chunk")
        via_http = [pool.submit(chat, oai, q, max_tokens=FREE_TOKENS) for q in FREE]
        beside = smollm2_server.generate(messages=messages, sampling_params=greedy)
        http_texts = [f.result()[0].text for f in via_http]
        free_done = time.monotonic()
        texts = [s.result() for s in streams]
    assert all(t > free_done for t in finished_at), "the constrained requests ran alongside the free ones"
    assert re.fullmatch(constrained[0]["regex"], texts[0]), texts[0]
    jsonschema.validate(json.loads(texts[1]), MEDIUM_SCHEMA)
    assert len(texts[2].split(", ")) == 25 and set(texts[2].split(", ")) <= {"yes", "no"}, texts[2]
    for a, b, h in zip(alone, beside, http_texts):
        assert b["output_ids"] == a["output_ids"], (a["text"], b["text"])
        assert h == a["text"], (a["text"], h)
    assert_idle_and_nothing_leaked(smollm2_server)


# ---------------------------------------------------------------------- text forced from mid-character
# Last in the module: before the fix below, this request stopped the server.


def test_forced_text_that_starts_mid_character_is_decoded_not_jumped(
    smollm2_server: ServedClient, oai: openai.OpenAI
) -> None:
    """The model's vocabulary has no token for a whole 🙂 (F0 9F 99 82): its first token is the
    partial 'F0 9F', and the text the grammar then forces starts with the byte 0x99, which is no
    UTF-8 string. xgrammar's find_jump_forward_string raised UnicodeDecodeError there, in the
    scheduler's loop, and the server shut down. Such a step now jumps nothing: the remaining
    bytes are decoded under the mask, and the output is the regex's."""
    pattern = "🙂🙃|(é|🙂){1,3} ok"
    prompt = "Reply with two emoji."
    with ThreadPoolExecutor(3) as pool:
        results = [
            pool.submit(zmq, smollm2_server, prompt, {"regex": "🙂🙃", "max_new_tokens": 16, "temperature": 0}),
            pool.submit(chat, oai, prompt, max_tokens=24, stream=True, extra_body={"regex": pattern}),
            pool.submit(chat, oai, prompt, max_tokens=24, seed=2, extra_body={"regex": pattern}, **SAMPLED),
        ]
        samples = [s for future in results for s in future.result()]
    assert samples[0].text == "🙂🙃" and samples[0].finish == "stop", samples[0]
    for sample in samples[1:]:
        assert sample.finish == "stop" and re.fullmatch(pattern, sample.text), sample
    assert_idle_and_nothing_leaked(smollm2_server)
