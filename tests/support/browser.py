"""The system's headless Chromium driven through selenium, and the chat page as a person uses it:
what the browser test (tests/e2e/test_chat_page_browser.py) and the README's screenshot
(tests/support/chat_screenshot.py) share. Debian's ``chromium`` and ``chromium-driver`` are given by
path, so selenium looks nothing up and downloads nothing; ``.ci/run`` installs them."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from typing import Any, Iterator

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60.0


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if shutil.which(path) is None:
            return f"needs the headless browser: {path} is missing (apt-get install -y {package})"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (pip install -e '.[test]')"
    return None


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """Headless Chromium through the system's chromedriver, quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        "--window-size=1200,800",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for console_errors
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


class ChatPage:
    """The page in the browser, as a person uses it (and what it shows)."""

    def __init__(self, driver: Any, url: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        self.wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.02)
        driver.get(url)

    def el(self, element_id: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def status(self) -> str:
        return str(self.el("status").text)

    def model(self) -> str:
        return str(self.el("model").text)

    def set_field(self, element_id: str, value: str) -> None:
        field = self.el(element_id)
        field.clear()
        field.send_keys(value)

    def send(self, text: str, *, click: bool = False) -> None:
        """Type ``text`` and send it (Enter, or the Send button), once the page may send."""
        from selenium.webdriver.common.keys import Keys

        before = self.count("assistant")
        self.el("input").send_keys(text)
        self.wait.until(lambda d: self.el("send").is_enabled(), "the Send button to be enabled")
        if click:
            self.el("send").click()
        else:
            self.el("input").send_keys(Keys.ENTER)
        self.wait.until(lambda d: self.count("assistant") == before + 1, "the reply to start")

    def count(self, role: str) -> int:
        return int(self.js("return document.querySelectorAll('#log .msg.' + arguments[0]).length", role))

    def last_reply(self) -> dict[str, Any]:
        """The last reply: its state, exact text (textContent: no whitespace folding), stats line
        and the numbers behind it."""
        reply: dict[str, Any] = self.js(
            """const m = [...document.querySelectorAll('#log .msg.assistant')].pop();
            const s = m.querySelector('.stats');
            return {state: m.dataset.state, text: m.querySelector('.content').textContent,
                    stats: s.textContent, numbers: {...s.dataset}};"""
        )
        return reply

    def finished_reply(self) -> dict[str, Any]:
        """The last reply once it is no longer streaming."""
        self.wait.until(lambda d: self.last_reply()["state"] != "streaming", "the reply to finish")
        return self.last_reply()

    def history(self) -> list[dict[str, str]]:
        """The chat as the log shows it: (role, text) of every message."""
        rows: list[dict[str, str]] = self.js(
            """return [...document.querySelectorAll('#log .msg')].map(m => ({
                role: m.classList.contains('user') ? 'user' : 'assistant',
                content: m.querySelector('.content').textContent}));"""
        )
        return rows


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last call: a script error or a blocked load (the page's
    Content-Security-Policy refuses anything from elsewhere). An HTTP error status the page
    handles (401 before the key is given) is logged too, and is no error of the page."""
    logs = driver.get_log("browser")
    return [
        e["message"]
        for e in logs
        if e["level"] == "SEVERE" and "the server responded with a status" not in e["message"]
    ]
