"""The README's screenshot of the chat page, docs/images/chat-page.png: a short exchange with the
default model (SmolLM2-135M-Instruct) in the system's headless Chromium.

    .venv/bin/python -m tests.support.chat_screenshot [--out docs/images/chat-page.png]

Run on a quiet machine: the page shows the reply's tokens/s.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Sequence

from tests.support import REPO_ROOT
from tests.support.browser import ChatPage, console_errors, headless_chromium, missing_browser
from tests.support.real_model import private_model_cache, start_real_model_server

SCREENSHOT = REPO_ROOT / "docs" / "images" / "chat-page.png"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SCREENSHOT)
    args = parser.parse_args(argv)
    missing = missing_browser()
    if missing is not None:
        raise SystemExit(missing)
    with tempfile.TemporaryDirectory() as cache, headless_chromium() as driver:
        server = start_real_model_server(
            private_model_cache(Path(cache)), ["--port", "0", "--device", "cpu", "--random-seed", "0"]
        )
        try:
            assert server.http_address is not None
            page = ChatPage(driver, server.http_address + "/")
            page.wait.until(lambda d: page.model() == "smollm2-135m-instruct", "the default model's name")
            page.set_field("system", "You are a helpful assistant.")
            page.set_field("temperature", "0")
            page.set_field("max-tokens", "96")
            for question in ("What is the capital of France?", "And what is it famous for?"):
                page.send(question)
                if page.finished_reply()["state"] != "done":
                    raise SystemExit(f"the reply to {question!r} did not finish: {page.last_reply()}")
            errors = console_errors(driver)
            if "Paris" not in page.history()[1]["content"] or errors:
                raise SystemExit(f"unexpected page: {page.history()} {errors}")
            page.el("input").send_keys("Thanks!")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
        finally:
            server.stop()
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
