"""benchmarks/attention_gpu.py's verdicts: which rows each target reads, and which way its
ratio points. CI has no GPU, so the rows here are made up; gpu_suite.sh's smoke run checks
the kernels' side of the script."""

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_benchmark(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("attention_gpu")


def _row(gpu, variant, impl, fwd_ms, fwdbwd_ms, n=8192):
    return gpu.Row(128, n, 2, 16, variant, impl, fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms,
                   flops_fwd=1e12)


def test_each_weighting_is_held_to_the_triton_softmax_of_its_shape(gpu_benchmark):
    gpu = gpu_benchmark
    rows = [
        _row(gpu, "dot", "qkv triton", 2.0, 8.0),
        _row(gpu, "causal", "qkv triton", 1.0, 4.0),
        _row(gpu, "dot", "sdpa flash", 1.6, 6.4),
        _row(gpu, "sigmoid", "qkv triton", 1.6, 8.4),  # forward 1.25x, fwd+bwd 0.95x
        _row(gpu, "softpick", "qkv triton", 2.2, 9.0),  # 0.89x
        _row(gpu, "stick_breaking", "qkv triton", 2.0, 8.0),  # against causal: 0.50x
        _row(gpu, "relu", "qkv triton", 1.0, 1.0, n=1024),  # another shape: not read
    ]
    lines = gpu.targets(rows, None)
    assert "- sigmoid fwd+bwd TFLOP/s vs the Triton softmax (dot): 0.95 (MISS, target >= 1.0)" \
        in lines
    assert "- sigmoid forward TFLOP/s vs the Triton softmax (dot): 1.25 (PASS, target >= 1.0)" \
        in lines
    assert "- sigmoid fwd+bwd speed vs SDPA flash (dot): 0.76" in lines
    assert "- softpick fwd+bwd TFLOP/s vs the Triton softmax (dot): 0.89 (PASS, target >= 0.8)" \
        in lines
    assert ("- stick_breaking fwd+bwd TFLOP/s vs the Triton softmax (causal): 0.50 (MISS, "
            "target >= 0.8)") in lines
    assert "- relu fwd+bwd TFLOP/s vs the Triton softmax (dot): not measured" in lines


def test_weighting_rows_run_only_the_kernels_and_name_their_weighting(gpu_benchmark):
    gpu = gpu_benchmark
    for name in gpu.WEIGHTINGS:
        variant = gpu.make_variant(name, 64, 16, 2, "cpu")
        assert list(gpu.implementations(variant)) == ["qkv triton"], name
        causal = name == "stick_breaking"
        assert (variant.kwargs["mask"] is not None) == causal, name
        assert variant.allowed == (64 * 65 // 2 if causal else 64 * 64), name
    assert gpu.make_variant("sigmoid", 64, 16, 2, "cpu").kwargs["weighting"] == "sigmoid"


def test_a_row_records_the_fields_the_results_file_promises(gpu_benchmark):
    """benchmarks/results' gpu rows: variant, impl, causal, d, n, fwd_ms, fwd_bwd_ms,
    fwd_tflops and fwd_bwd_tflops (issue 46's shape), causal read from the variant's mask."""
    gpu = gpu_benchmark
    causal = {name: gpu.make_variant(name, 64, 16, 2, "cpu").causal
              for name in ("dot", "causal", "window", "segments", "l1_causal", "stick_breaking",
                           "sigmoid")}
    assert causal == {"dot": False, "causal": True, "window": True, "segments": False,
                      "l1_causal": True, "stick_breaking": True, "sigmoid": False}
    record = gpu.Row(128, 8192, 2, 16, "causal", "qkv triton", True, fwd_ms=2.0, fwdbwd_ms=8.0,
                     flops_fwd=1e12).record()
    assert {"variant", "impl", "causal", "d", "n", "fwd_ms", "fwd_bwd_ms", "fwd_tflops",
            "fwd_bwd_tflops"} <= set(record)
    assert (record["causal"], record["fwd_tflops"], record["fwd_bwd_tflops"]) == (True, 500.0,
                                                                                 437.5)
