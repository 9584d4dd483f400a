"""Long commands show tqdm progress bars on a terminal and nothing extra when their output is
piped (the commands run as subprocesses, on a pseudo-terminal and on pipes)."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from qkv.cli import main


def on_terminal(*argv: str) -> tuple[int, str]:
    """Run ``qkv ARGV`` with stderr on a pseudo-terminal; (exit code, what stderr showed)."""
    leader, follower = pty.openpty()
    # A terminal has a size (tqdm draws nothing in zero columns).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "qkv.cli", *argv], stdout=subprocess.PIPE,
                            stderr=follower, env=dict(os.environ, OMP_NUM_THREADS="1"))
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    proc.communicate(timeout=300)
    return proc.returncode, shown.decode(errors="replace")


def piped(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv.cli", *argv], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lm") / "run"
    assert main(["train", "lm", "--preset", "tiny", "--run-dir", str(run_dir), "--quiet"]) == 0
    return run_dir


def test_viz_shows_a_bar_on_a_terminal_only(lm_run, tmp_path):
    argv = ["viz", str(lm_run), "--text", "Return the", "-o", str(tmp_path / "a.html")]
    code, shown = on_terminal(*argv)
    assert code == 0 and "attention maps: " in shown and "row/s]" in shown, shown
    quiet = piped(*argv)
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.slow  # loads SmolLM2 twice
def test_eval_model_shows_loading_and_scoring_bars(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("Attention is a weighted average of values. " * 40)
    argv = ["eval", "--model", "smollm2", "--text", str(text), "--window", "32",
            "--max-tokens", "256"]
    code, shown = on_terminal(*argv)
    assert code == 0 and "loading SmolLM2-135M-Instruct.Q4_1.gguf: " in shown, shown
    assert "scoring: " in shown and "batch/s]" in shown
    quiet = piped(*argv)
    assert quiet.returncode == 0 and quiet.stderr == ""
