"""Default sampling on the default model: share of simple factual chats answered right when the
request sets no temperature, under ``--sampling-defaults openai`` (temperature 1.0: "before" issue 47)
and ``--sampling-defaults model`` (the model's defaults: SmolLM2-135M-Instruct's 0.2 / top_p 0.9).

Each mode starts its own server (``launch.py --model-path smollm2-135m-instruct --device cpu`` unless
``--model-path`` / ``--server-flags`` say otherwise) and sends the same ``QUESTIONS`` as OpenAI chats
with only ``max_tokens`` (and, for reproducible reruns, a ``seed`` per chat: a seed does not change
the distribution sampled from). An answer counts as right when it contains one of the question's
accepted words; lenient (a rambling answer that mentions "Paris" counts), which favours the "before".

    .venv/bin/python -m bench.default_sampling                      # both modes, 20 chats each
    .venv/bin/python -m bench.default_sampling --repeats 5          # 100 chats per mode
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from bench.common import default_output_path, machine_info, print_table, write_json

# (question, regex of an accepted answer): simple facts with one known answer.
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("What is the capital of Italy?", r"\brome\b"),
    ("What is the capital of Germany?", r"\bberlin\b"),
    ("What is the capital of Spain?", r"\bmadrid\b"),
    ("What is the capital of the United Kingdom?", r"\blondon\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("Which planet is known as the Red Planet?", r"\bmars\b"),
    ("How many days are there in a week?", r"\b(seven|7)\b"),
    ("How many legs does a spider have?", r"\b(eight|8)\b"),
    ("What is the chemical formula of water?", r"\bh2o\b|h₂o"),
    ("Which gas do plants take in from the air for photosynthesis?", r"carbon dioxide|\bco2\b|co₂"),
    ("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    ("At how many degrees Celsius does water boil at sea level?", r"\b100\b"),
    ("What is the largest ocean on Earth?", r"\bpacific\b"),
    ("How many continents are there on Earth?", r"\b(seven|7)\b"),
    ("At how many degrees Celsius does water freeze?", r"\b(zero|0)\b"),
    ("What color is the sky on a clear day?", r"\bblue\b"),
    ("Which animal is known as the king of the jungle?", r"\blions?\b"),
    ("What is 2 + 2?", r"\b(four|4)\b"),
)
MODES = ("openai", "model")
COLUMNS = [("mode", "--sampling-defaults"), ("params", "defaults in force"), ("right", "right"), ("share", "share")]


def is_right(answer: str, accepted: str) -> bool:
    """Whether ``answer`` contains an accepted answer (case-insensitive)."""
    return re.search(accepted, answer, re.IGNORECASE) is not None


def _post(url: str, body: dict[str, Any], api_key: str | None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=300) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start a server under ``--sampling-defaults mode`` and ask every question ``args.repeats`` times."""
    from tests.support.server_process import launch_server  # a benchmark starts servers as the tests do

    argv = ["--model-path", args.model_path, "--device", args.device, "--sampling-defaults", mode, *args.server_flags]
    chats: list[dict[str, Any]] = []
    with launch_server(argv, ready_timeout=600, client_timeout=300) as client:
        base = client.server.http_address
        assert base is not None
        info = _get(base + "/get_model_info")
        model = _get(base + "/v1/models")["data"][0]["id"]
        for repeat in range(args.repeats):
            for i, (question, accepted) in enumerate(QUESTIONS):
                body: dict[str, Any] = {
                    "model": model,
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": args.max_tokens,
                }
                if args.seed is not None:
                    body["seed"] = args.seed + repeat * len(QUESTIONS) + i
                answer = _post(base + "/v1/chat/completions", body, None)["choices"][0]["message"]["content"]
                chats.append({"question": question, "answer": answer, "right": is_right(answer, accepted)})
                if args.verbose:
                    print(f"[{mode}] {'ok ' if chats[-1]['right'] else 'BAD'} {question} -> {answer!r}")
    right = sum(c["right"] for c in chats)
    effective = info["effective_sampling_params"]
    return {
        "mode": mode,
        "params": f"temperature {effective['temperature']:g}, top_p {effective['top_p']:g}",
        "model_info": info,
        "right": f"{right}/{len(chats)}",
        "share": right / len(chats),
        "chats": chats,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=1, help="times each question is asked per mode")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="first chat's seed (reruns reproduce); -1: unseeded")
    parser.add_argument("--server-flags", nargs=argparse.REMAINDER, default=[], help="more launch.py flags (last)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (default: bench/results/)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every answer")
    args = parser.parse_args(argv)
    if args.seed < 0:
        args.seed = None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [run_mode(mode, args) for mode in args.modes]
    print_table(rows, COLUMNS, title=f"{len(QUESTIONS) * args.repeats} chats without temperature, {args.model_path}")
    machine = machine_info()
    print(f"machine: {machine['cpu_model']}")
    out = write_json(args.output or default_output_path("default_sampling", "cpu"), {"machine": machine, "runs": rows})
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
