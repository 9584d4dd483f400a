"""`qkv generate RUN` streams its text as it is sampled; Ctrl-C keeps what was printed."""

import os
import signal
import subprocess
import sys

from qkv.cli import main

from .conftest import tiny_lm


def test_generate_from_a_run_streams_and_ctrl_c_keeps_the_text(tmp_path):
    run_dir = tmp_path / "run"
    assert main(tiny_lm(run_dir, 4)) == 0
    # Ctrl-C as a terminal delivers it: a suite started in the background (`make test &`)
    # ignores SIGINT, and a child would inherit that and never see the signal.
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkv.cli", "generate", str(run_dir), "--prompt", "Return",
         "--max-new-tokens", "1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # The prompt and the first sampled characters arrive while the model still writes.
        first = proc.stdout.read(20)
        assert first.startswith(b"Return") and proc.poll() is None
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.decode().strip() == "qkv: interrupted"
    text = (first + rest).decode()
    assert len(text) > 20 and text.endswith("\n")  # what was printed stays, line ended
