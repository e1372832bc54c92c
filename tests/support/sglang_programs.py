"""SGLang frontend-language programs (``sglang.lang``), run against a tinyserve server as a user's
script would: ``python -m tests.support.sglang_programs URL API_KEY`` prints one JSON object with
what each program produced (tests/e2e/test_sglang_frontend_e2e.py checks it).

A separate process on purpose: importing ``sglang`` patches transformers (its config validation,
its attention classes) and sets cache environment variables, which must not leak into the test
process that uses transformers as its oracle.

SmolLM2's chat format is ChatML; SGLang picks a template by the model path's name and knows no
SmolLM2, so the endpoint is told (``chat_template_name="chatml"``), as a user would.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import sglang as sgl

SYSTEM = "You are a helpful assistant. Answer in a few words."
CAPITALS = ("France", "Japan", "England")


@sgl.function
def capital(s: Any, country: str) -> None:
    """Roles, and a greedy gen with a stop string and a token budget."""
    s += sgl.system(SYSTEM)
    s += sgl.user(f"What is the capital of {country}?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0, stop="\n"))


@sgl.function
def sky_colour(s: Any) -> None:
    """select: each choice scored by its prompt logprobs."""
    s += sgl.system(SYSTEM)
    s += sgl.user("What colour is the sky on a clear day?")
    s += sgl.assistant_begin()
    s += "The sky is" + sgl.select("colour", choices=[" blue", " green", " red", " purple"])
    s += sgl.assistant_end()


@sgl.function
def constrained(s: Any) -> None:
    """gen with dtype=int (SGLang's integer regex) and with a regex."""
    s += sgl.system(SYSTEM)
    s += sgl.user("Count from one to ten.")
    s += sgl.assistant_begin()
    s += "1, 2, 3, 4, " + sgl.gen("next", dtype=int, max_tokens=4, temperature=0)
    s += sgl.assistant_end()
    s += sgl.user("Is water wet? Answer yes or no.")
    s += sgl.assistant(sgl.gen("wet", regex="(yes|no)", max_tokens=4, temperature=0))


@sgl.function
def two_tips(s: Any, topic: str) -> None:
    """fork: two continuations of one prompt (in parallel, on the server's shared prefix)."""
    s += sgl.system(SYSTEM)
    s += sgl.user(f"Give one short tip about {topic}.")
    forks = s.fork(2)
    for i, fork in enumerate(forks):
        fork += sgl.assistant(sgl.gen("tip", max_tokens=12, temperature=0.0 if i == 0 else 0.7, stop="\n"))
    s += sgl.user("Thanks.")
    s += sgl.assistant("Tips: " + forks[0]["tip"] + " | " + forks[1]["tip"])


def run(url: str, api_key: str) -> dict[str, Any]:
    backend = sgl.RuntimeEndpoint(url, api_key=api_key, chat_template_name="chatml")
    sgl.set_default_backend(backend)
    out: dict[str, Any] = {"model_path": backend.get_model_name()}
    first = capital.run(country=CAPITALS[0])
    out["capital"] = {"answer": first["answer"], "text": first.text()}
    batch = capital.run_batch([{"country": c} for c in CAPITALS], temperature=0)
    out["batch"] = [state["answer"] for state in batch]
    streamed = capital.run(country=CAPITALS[1], stream=True)
    out["stream"] = {"pieces": list(streamed.text_iter("answer")), "answer": streamed["answer"]}
    sky = sky_colour.run()
    out["select"] = {"colour": sky["colour"], "meta": sky.get_meta_info("colour")["normalized_prompt_logprobs"]}
    numbers = constrained.run()
    out["constrained"] = {"next": numbers["next"], "wet": numbers["wet"]}
    tips = two_tips.run(topic="sleep")
    out["fork"] = {"text": tips.text(), "messages": tips.messages()}
    out["server_info_keys"] = sorted(backend.get_server_info())
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])))
