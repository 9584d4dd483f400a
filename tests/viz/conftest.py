"""A headless Debian Chromium driven by Selenium, for the page tests (never downloads a browser).

Without Chromium the browser tests skip on a developer machine and fail under CI=true."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ENABLE = (
    "to run it: sudo apt-get install chromium chromium-driver && .venv/bin/pip install selenium "
    "(.ci/run does this)"
)
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1000,900",
)


def _missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is missing"
    return None


def unavailable(reason: str | None, ci: str | None) -> tuple[str, str] | None:
    """None when the browser can run; else ("fail" under CI=true, or "skip", the message)."""
    if reason is None:
        return None
    if ci == "true":
        return "fail", f"browser test must run under CI=true but {reason}; {ENABLE}"
    return "skip", f"browser test skipped: {reason}; {ENABLE}"


def headless_chromium(tmp_path_factory, keep_console: bool = False):
    """A headless Chromium driver, for a fixture to yield from (it quits and removes its
    profile after); with ``keep_console``, ``driver.get_log("browser")`` returns the page's
    console messages."""
    verdict = unavailable(_missing(), os.environ.get("CI"))
    if verdict is not None:
        action, message = verdict
        (pytest.fail if action == "fail" else pytest.skip)(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    if keep_console:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    profile = tmp_path_factory.mktemp("chromium-profile")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    yield from headless_chromium(tmp_path_factory)
