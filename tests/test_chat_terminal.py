"""`qkv chat` in a real terminal (tmux): line history, Ctrl-C stops a reply, a second Ctrl-C
or Ctrl-D ends the chat, a cut-off reply says so, --stats prints tokens/s."""

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # loads SmolLM2 in a subprocess

SRC = Path(__file__).resolve().parents[1] / "src"
# How long a screen may take to appear. On an idle 2-core machine the model loads and a reply
# runs within seconds; with two other heavy jobs on the same cores, several times as long,
# and 120 s is not enough. A wait ends as soon as its screen shows: only a failing test waits
# this long.
PATIENCE = 600.0

if shutil.which("tmux") is None:
    if os.environ.get("CI"):
        raise RuntimeError("tmux is missing; .ci/run installs it")
    pytest.skip("tmux is not installed (apt-get install tmux)", allow_module_level=True)


class Terminal:
    """A detached tmux session running one command; ``screen()`` is what a user sees.

    Each terminal has a tmux server of its own (``-L``): on a shared server, a session
    started while the previous test's last session was being killed met the server on its
    way out ("server exited unexpectedly", seen once in CI)."""

    def __init__(self, command: str):
        self.name = f"qkv-chat-{uuid.uuid4().hex[:8]}"
        env = f"PYTHONPATH={SRC} QKV_CACHE={os.environ.get('QKV_CACHE', '')}"
        # The exit status stays on the screen after the command ends.
        shell = f"env {env} {command}; echo EXIT=$?; sleep 120"
        self.tmux("new-session", "-d", "-s", self.name, "-x", "150", "-y", "50", shell)
        self.socket = Path(self.tmux("display-message", "-p", "#{socket_path}").strip())

    def tmux(self, *args: str, check: bool = True) -> str:
        return subprocess.run(["tmux", "-L", self.name, *args], check=check,
                              capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", self.name)

    def wait_for(self, predicate, timeout: float = PATIENCE) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.05)
        raise AssertionError(f"timed out; the screen:\n{self.screen()}")

    def close(self) -> None:
        self.tmux("kill-server", check=False)
        self.socket.unlink(missing_ok=True)  # tmux leaves its socket file behind


@pytest.fixture
def chat():
    terminals = []

    def start(*flags: str) -> Terminal:
        terminals.append(Terminal(f"{sys.executable} -m qkv.cli chat --model smollm2 "
                                  + " ".join(flags)))
        return terminals[-1]

    yield start
    for terminal in terminals:
        terminal.close()


def prompts(text: str) -> int:
    return sum(line.startswith("you> ") for line in text.splitlines())


def test_chat_in_a_terminal(chat):
    term = chat("--max-new-tokens", "80", "--stats")
    term.wait_for(lambda s: s.rstrip().endswith("you>"))
    term.keys("Write a long story about a cat.", "Enter")
    # Ctrl-C as soon as the reply has begun: it stops, and the prompt returns.
    term.wait_for(lambda s: "model> " in s and len(s.split("model> ", 1)[1].strip()) > 5)
    term.keys("C-c")
    screen = term.wait_for(lambda s: "[stopped]" in s and prompts(s) == 2)
    assert "EXIT=" not in screen
    # Up recalls the last line (readline history); this time the reply runs to the limit.
    term.keys("Up", "Enter")
    screen = term.wait_for(lambda s: "tokens/s]" in s and prompts(s) == 3)
    assert screen.count("you> Write a long story about a cat.") == 2
    assert "[cut off at --max-new-tokens 80; raise it for longer replies]" in screen
    assert "[80 tokens in " in screen
    # Ctrl-C at an idle prompt says how to end; a second one ends the chat.
    term.keys("C-c")
    term.wait_for(lambda s: s.count("(Ctrl-C again or Ctrl-D ends the chat)") == 2)
    term.keys("C-c")
    assert "EXIT=0" in term.wait_for(lambda s: "EXIT=" in s)


def test_ctrl_d_ends_the_chat(chat):
    term = chat("--max-new-tokens", "4")
    term.wait_for(lambda s: s.rstrip().endswith("you>"))
    term.keys("Hi", "Enter")
    term.wait_for(lambda s: prompts(s) == 2)
    term.keys("C-d")
    assert "EXIT=0" in term.wait_for(lambda s: "EXIT=" in s)
