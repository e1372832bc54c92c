"""The OpenAI reply builder without a server: a chat choice's text through the reasoning and
tool-call parsers gives the same message whole and streamed (cut at every offset), for every
tool_choice mode; finish reasons; usage so far; echoed prompt logprobs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.protocol.messages import ChunkMeta, GenerateChunk
from tokenizer_proc.openai_reply import ChatChoice, LogprobFormatter, OutputParsing, Usage
from tokenizer_proc.openai_tools import ToolPlan

NAMES = ("weather", "clock")
PARSE = ToolPlan("parse", [], NAMES, {})
NAMED = ToolPlan("named", [], NAMES, {"json_schema": "{}"}, named="weather")
REQUIRED = ToolPlan("required", [], NAMES, {"json_schema": "{}"})
NONE = ToolPlan("none", None, (), {})
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

CASES: list[tuple[str, OutputParsing, str, dict[str, Any]]] = [
    (
        "reasoning, text, then a call",
        OutputParsing(PARSE, "hermes", "qwen3"),
        "<think>\nlook it up\n</think>\n\nSure.\n" + CALL,
        {"reasoning": "look it up", "content": "Sure.\n", "calls": [("weather", {"city": "Oslo"})]},
    ),
    (
        "a call to an unknown tool stays text",
        OutputParsing(PARSE, "hermes"),
        CALL.replace("weather", "rocket"),
        {"reasoning": None, "content": CALL.replace("weather", "rocket"), "calls": []},
    ),
    (
        "named: the output is the arguments",
        OutputParsing(NAMED, "hermes", "qwen3", constrained=True),
        '{"city": "Lima"}',
        {"reasoning": None, "content": None, "calls": [("weather", {"city": "Lima"})]},
    ),
    (
        "required: a list of calls",
        OutputParsing(REQUIRED, None, "deepseek-r1", constrained=True),
        '[{"name": "weather", "arguments": {"city": "Rome"}}, {"name": "clock", "arguments": {}}]',
        {"reasoning": None, "content": None, "calls": [("weather", {"city": "Rome"}), ("clock", {})]},
    ),
    (
        "required, cut short: text",
        OutputParsing(REQUIRED, None, None, constrained=True),
        '[{"name": "weather", "argu',
        {"reasoning": None, "content": '[{"name": "weather", "argu', "calls": []},
    ),
    (
        "forced reasoning (the template opened it)",
        OutputParsing(NONE, None, "deepseek-r1"),
        "weigh it</think>The answer.",
        {"reasoning": "weigh it", "content": "The answer.", "calls": []},
    ),
    (
        "a constrained reply is not forced reasoning",
        OutputParsing(NONE, None, "deepseek-r1", constrained=True),
        '{"a": 1}',
        {"reasoning": None, "content": '{"a": 1}', "calls": []},
    ),
    (
        "thinking off: all content",
        OutputParsing(NONE, None, "qwen3", enable_thinking=False),
        "<think>x</think>y",
        {"reasoning": None, "content": "<think>x</think>y", "calls": []},
    ),
]


def whole(parsing: OutputParsing, text: str) -> dict[str, Any]:
    message = ChatChoice(parsing).message(text)
    return {
        "reasoning": message.get("reasoning_content") or None,
        "content": message["content"],
        "calls": [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
        ],
    }


def streamed(parsing: OutputParsing, pieces: list[str]) -> dict[str, Any]:
    choice = ChatChoice(parsing)
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = choice.delta(piece, finished=i == len(pieces) - 1)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["id"].startswith("call_") and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))],
    }


@pytest.mark.parametrize("name, parsing, text, expected", CASES, ids=[c[0] for c in CASES])
def test_whole_and_streamed_choices_agree(
    name: str, parsing: OutputParsing, text: str, expected: dict[str, Any]
) -> None:
    assert whole(parsing, text) == expected
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        assert streamed(parsing, pieces) == expected, pieces


def test_finish_reason_is_tool_calls_only_for_a_stop_with_calls() -> None:
    def chunk(reason: str) -> GenerateChunk:
        return GenerateChunk(rid="r", text="", output_ids=[], finished=True, finish_reason={"type": reason})

    with_call = ChatChoice(OutputParsing(PARSE, "hermes"))
    with_call.message(CALL)
    assert with_call.finish_reason(chunk("stop")) == "tool_calls"
    assert with_call.finish_reason(chunk("length")) == "length"
    plain = ChatChoice(OutputParsing(PARSE, "hermes"))
    plain.message("no call here")
    assert plain.finish_reason(chunk("stop")) == "stop"


def test_usage_so_far_counts_each_prompt_once_and_every_sample() -> None:
    usage = Usage()

    def add(prompt: int, sample: int, done: int, prompt_tokens: int = 7) -> None:
        usage.add(
            prompt,
            GenerateChunk(
                rid="r",
                text="",
                output_ids=[],
                finished=False,
                meta=ChunkMeta(index=sample, prompt_tokens=prompt_tokens, completion_tokens=done, cached_tokens=2),
            ),
        )

    add(0, 0, 1)
    add(0, 1, 1)
    add(0, 0, 3)
    add(1, 0, 2, prompt_tokens=5)
    assert usage.as_dict() == {
        "prompt_tokens": 12,
        "completion_tokens": 6,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


class _CharTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_echoed_logprobs_put_the_prompt_first() -> None:
    meta = ChunkMeta(
        input_token_logprobs=[[None, 0], [-1.5, 1]],
        input_top_logprobs=[None, [[-1.0, 2], [-1.5, 1]]],
        output_token_logprobs=[[-0.5, 3]],
        output_top_logprobs=[[[-0.5, 3]]],
    )
    out = LogprobFormatter(_CharTokenizer()).completion(meta, 0, echo=True)
    assert out == {
        "tokens": ["a", "b", "d"],
        "token_logprobs": [None, -1.5, -0.5],
        "text_offset": [0, 1, 2],
        "top_logprobs": [None, {"c": -1.0, "b": -1.5}, {"d": -0.5}],
    }
    plain = LogprobFormatter(_CharTokenizer()).completion(meta, 4)
    assert plain["tokens"] == ["d"] and plain["text_offset"] == [4]
