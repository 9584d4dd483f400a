"""benchmarks/results.py: the record a benchmark leaves says what ran, the dispatch variables
that chose the code among it."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _results_module():
    spec = importlib.util.spec_from_file_location("results", ROOT / "benchmarks" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recorded_command_names_the_dispatch_variables_that_were_set(monkeypatch, tmp_path):
    results = _results_module()
    monkeypatch.setenv("QKV_RESULTS_DIR", str(tmp_path))
    for key in results.DISPATCH_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("QKV_FLASH", "0")
    monkeypatch.setenv("QKV_ONEDNN_LINEAR", "0")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "generate_cpu.py"), "--new",
                                      "32"])
    path = results.write_results("generate_cpu", [{"report": "decode", "tokens_per_s": 1.0}])
    monkeypatch.delenv("QKV_FLASH")
    monkeypatch.delenv("QKV_ONEDNN_LINEAR")
    results.write_results("generate_cpu", [{"report": "decode", "tokens_per_s": 2.0}])
    runs = json.loads(path.read_text())["runs"]
    assert [run["command"] for run in runs] == [
        "QKV_FLASH=0 QKV_ONEDNN_LINEAR=0 benchmarks/generate_cpu.py --new 32",
        "benchmarks/generate_cpu.py --new 32",
    ]
    assert [run["rows"][0]["tokens_per_s"] for run in runs] == [1.0, 2.0]
