"""The README's "Real models" lines run as printed, after `make demo` has set up .venv.

The lines are read from README.md itself: each command runs in a fresh shell (bash, PATH
without the virtual environment) after the section's set-up lines that precede it, in a
folder that shows the checkout's files. `qkv chat` gets a question on standard input; the
fine-tune, minutes long, must print its plan, and is then stopped with Ctrl-C (SIGINT).
"""

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # four commands, each loading a real checkpoint

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
TIMEOUT = 600

if not (VENV_BIN / "qkv").exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{VENV_BIN / 'qkv'} is missing; `make test` installs it")
    pytest.skip("the README's commands need the .venv that make sets up",
                allow_module_level=True)


def section_lines(title: str) -> list[str]:
    """The non-blank lines of the first code block under ``## title`` in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```\n(.*?)^```$", section, re.S | re.M).group(1)
    return [line for line in block.splitlines() if line.strip()]


LINES = section_lines("Real models")
COMMANDS = [line for line in LINES if line.startswith("qkv ")]


def script_for(command: str) -> str:
    """The set-up lines (not qkv commands) before ``command``, then ``command``."""
    before = LINES[:LINES.index(command)]
    return "\n".join([line for line in before if not line.startswith("qkv ")] + [command])


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A folder holding links to the checkout's files: the README's lines see what they
    would in the checkout, and what they write (notes.txt, runs/) stays in the folder."""
    folder = tmp_path_factory.mktemp("checkout")
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", "notes.txt"):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture(scope="module")
def fresh_env():
    """The environment of a new login shell: no virtual environment on the PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if Path(p).resolve() != VENV_BIN.resolve())
    return env


def shell(script: str, cwd: Path, env: dict, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-e", "-c", script], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **kwargs)


def test_the_section_has_the_commands_this_test_drives():
    assert [c.split()[1] for c in COMMANDS] == ["generate", "chat", "embed", "train"]


def test_the_set_up_lines_put_the_venvs_qkv_on_the_path(checkout, fresh_env):
    bare = subprocess.run(["bash", "-c", "command -v qkv"], cwd=checkout, env=fresh_env,
                          capture_output=True, text=True)
    assert bare.returncode != 0, f"qkv is on the PATH without the README: {bare.stdout}"
    found = subprocess.run(["bash", "-e", "-c", script_for(COMMANDS[0]).rsplit("\n", 1)[0]
                            + "\ncommand -v qkv"], cwd=checkout, env=fresh_env,
                           capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve() == (VENV_BIN / "qkv").resolve()


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.split()[1] != "train"])
def test_a_command_runs_as_printed(command, checkout, fresh_env):
    question = "What is the capital of France?\n" if command.split()[1] == "chat" else ""
    proc = shell(script_for(command), checkout, fresh_env, stdin=subprocess.PIPE)
    out, err = proc.communicate(question, timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "Paris" in out or command.split()[1] == "embed", out
    if command.split()[1] == "embed":
        assert re.search(r"Someone is eating\.\s+0\.\d{3}\s+1\.000\s+\[1\]", out), out


def test_the_fine_tune_plans_then_stops_on_ctrl_c(checkout, fresh_env):
    (command,) = [c for c in COMMANDS if c.split()[1] == "train"]
    proc = shell(script_for(command), checkout, fresh_env, stdin=subprocess.DEVNULL)
    timer = threading.Timer(TIMEOUT, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("plan: "):
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest = proc.stderr.read()
        proc.wait()
    finally:
        timer.cancel()
    assert lines and lines[-1].startswith("plan: "), "".join(lines) + rest
    assert re.match(r"plan: 134\.5M parameters \| 1,024 tokens/step x \d+ steps \(", lines[-1])
    assert proc.returncode == 130, rest
    assert "qkv: interrupted" in rest
