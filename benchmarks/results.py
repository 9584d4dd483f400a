"""Machine-readable results: every benchmark script writes what it prints to
``benchmarks/results/<name>-<date>-<machine>.json``, and docs/performance.md quotes them.

One file per script, day and machine. A later run on the same day and machine is appended to
its ``runs``, so the last run is the current one::

    {"name": "attention_cpu", "date": "2026-11-27", "machine": "amd-epyc-zen4",
     "device": "AMD EPYC (Zen 4, AVX512)", "torch": "2.13.0+cpu", "threads": 2,
     "runs": [{"time": "11:24 UTC", "command": "benchmarks/attention_cpu.py --vs-sdpa ...",
               "commit": "09e87e5...", "rows": [{"report": "vs_sdpa", "variant": ...}]}]}

Rows are flat dicts of numbers and strings (times in ms or s as their keys say). On a GPU the
device is the CUDA device's name (``gpu-2026-11-27-nvidia-h200.json`` for attention_gpu.py)
and the file also gives the CUDA and Triton versions. ``QKV_RESULTS_DIR`` writes elsewhere
(benchmarks/gpu_suite.sh sets it to its OUT_DIR, whose files come back from a device call);
``QKV_RESULTS_DIR=off`` writes nothing.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "benchmarks" / "results"


def _cpuinfo() -> dict[str, str]:
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _amd_core(family: int, model: int) -> str | None:
    """AMD's core generation from the CPU family and model, where the model name (often just
    "AMD EPYC" on a virtual machine) does not say it."""
    if family == 23:
        return "Zen 2" if model >= 0x30 else "Zen"
    if family == 25:
        return "Zen 4" if 0x10 <= model < 0x20 or 0x60 <= model < 0x80 or model >= 0xA0 \
            else "Zen 3"
    if family == 26:
        return "Zen 5"
    return None


def cpu_name() -> str:
    """The CPU's model name, with AMD's core generation where the name lacks it."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    if info.get("vendor_id") == "AuthenticAMD" and "Zen" not in name:
        try:
            core = _amd_core(int(info["cpu family"]), int(info["model"]))
        except (KeyError, ValueError):
            core = None
        if core:
            name = f"{name} ({core})"
    return name


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*$", " ", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def device_info(device: str | torch.device = "cpu") -> dict:
    """What a result was measured on: ``machine`` (the file name's part) and ``device`` (the
    words docs/performance.md names it by), and the library versions."""
    device = torch.device(device)
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        info.update(machine=_slug(name), device=name, cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info.update(machine=_slug(info["cpu"]),
                    device=f"{info['cpu']}, {info['cpu_capability']}, "
                           f"{info['threads']} threads")
    return info


def _commit() -> str | None:
    """This checkout's commit, when the qkv that ran is this checkout's (a benchmark may run
    an older tree's src through PYTHONPATH: then its source path says what ran)."""
    try:
        import qkv

        if ROOT / "src" not in Path(qkv.__file__).resolve().parents:
            return None
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=False, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, check=False, timeout=10)
    except (ImportError, OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() + (" (src modified)" if dirty.stdout.strip() else "")


# The environment variables that change which code runs: a command that set them is not the
# same measurement without them.
DISPATCH_VARIABLES = ("QKV_FLASH", "QKV_ONEDNN_LINEAR", "QKV_FEW_ROWS_LINEAR", "QKV_ROW_OPS",
                      "QKV_NATIVE", "QKV_MARCH")


def _command(name: str) -> str:
    """The command line that ran: a script relative to the checkout (``qkv bench`` by its
    executable's name), after the dispatch variables that were set (``QKV_FLASH=0 ...``)."""
    if not sys.argv or not sys.argv[0]:
        return name
    script = Path(sys.argv[0]).resolve()
    shown = (str(script.relative_to(ROOT)) if script.suffix == ".py" and ROOT in script.parents
             else script.name)
    settings = [f"{key}={os.environ[key]}" for key in DISPATCH_VARIABLES if key in os.environ]
    return " ".join([*settings, shlex.join([shown, *sys.argv[1:]])])


def _qkv_source() -> str | None:
    """The qkv package that ran, relative to this checkout where it is inside it."""
    try:
        import qkv
    except ImportError:
        return None
    path = Path(qkv.__file__).resolve().parent
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def write_results(name: str, rows: list[dict], device: str | torch.device = "cpu",
                  **extra) -> Path | None:
    """Append one run's ``rows`` to ``<dir>/<name>-<date>-<machine>.json`` and return its
    path (None when ``QKV_RESULTS_DIR=off``). ``extra`` goes into the run (settings such as
    dtype or rounds)."""
    where = os.environ.get("QKV_RESULTS_DIR", "")
    if where == "off":
        return None
    info = device_info(device)
    now = time.gmtime()
    date = time.strftime("%Y-%m-%d", now)
    directory = Path(where) if where else DEFAULT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{date}-{info['machine']}.json"
    run = {"time": time.strftime("%H:%M UTC", now), "command": _command(name),
           "commit": _commit(), "qkv_source": _qkv_source(), **extra, "rows": rows}
    record = {"name": name, "date": date, **info, "runs": []}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            if isinstance(old.get("runs"), list):
                record["runs"] = old["runs"]
        except (OSError, ValueError):
            pass
    record["runs"].append(run)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(path)
    shown = path.relative_to(Path.cwd()) if Path.cwd() in path.parents else path
    print(f"results: {shown}", file=sys.stderr)
    return path
