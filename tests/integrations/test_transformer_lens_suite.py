"""TransformerLens's own bridge hook tests, from its 4.3.0 sdist, run with qkv as the bridge's
attention (transformer_lens_plugin.py), in a child pytest.

The sdist comes from PyPI (``make install`` downloads it into .venv/sdists with
``pip download --no-deps --no-binary :all: transformer-lens==4.3.0``; $QKV_TL_SDIST names
another copy); its tests/ folder is extracted into a temporary directory and run there.
What runs, and what is left out and why, is listed below.
"""

import os
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("transformer_lens")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

SELECTED = [
    # The pattern seam on native bridges: edits reach the output, an observing hook keeps
    # the logits bit for bit, the cache holds the edited pattern, the hook fires once. These
    # bridges wrap TransformerLens's own NativeAttention (no transformers model under them),
    # so they run its attention, not qkv's: they check that the seam qkv plugs into behaves.
    "tests/unit/model_bridge/test_boot_native.py::TestPatternHookWrites",
    # Post-hoc firing on a delegating AttentionBridge over a module without the seam: the
    # warning for discarded edits, silence for read-only hooks (qkv leaves that path alone).
    "tests/unit/model_bridge/generalized_components/test_attention_post_hoc_hooks.py",
    # run_with_cache(pos_slice=...) on every cached activation, patterns and gradients
    # included (incl_bwd), on qkv: "distilgpt2" boots the plugin's tiny local LLaMA (6
    # layers, as distilgpt2 has).
    "tests/integration/model_bridge/test_bridge_run_with_cache_pos_slice.py",
    # Gradients in the cache (incl_bwd), the hooks it leaves behind, hook scopes and caching
    # hooks, on the same stand-in; gated hooks on a tiny BERT built from a config.
    "tests/integration/model_bridge/test_bridge_run_with_cache_incl_bwd.py",
    "tests/integration/model_bridge/test_bridge_hook_scope.py",
    "tests/integration/model_bridge/test_bridge_caching_hooks.py",
    "tests/unit/model_bridge/test_gated_hooks.py",
]

LEFT_OUT = [
    # Compares with a golden snapshot of distilgpt2's gradients, fetched from the hub.
    "tests/integration/model_bridge/test_bridge_run_with_cache_incl_bwd.py::"
    "test_incl_bwd_gradients_match_the_golden_snapshot",
]

# Left out of TransformerLens's other bridge tests:
# - the ones that boot a hub checkpoint (gpt2, pythia, tiny-stories, ... and their goldens):
#   there is no model hub on these machines;
# - tests/acceptance, tests/benchmarks and the notebook (nbval) runs: they download models.


def _sdist() -> Path:
    name = f"transformer_lens-{version('transformer-lens')}.tar.gz"
    path = Path(os.environ.get("QKV_TL_SDIST", ROOT / ".venv" / "sdists" / name))
    if not path.exists():
        pytest.skip(f"TransformerLens's sdist is not at {path} (make install downloads it)")
    return path


def _extract(sdist: Path, into: Path) -> Path:
    """The sdist's tests/ folder under ``into``, with a pytest.ini of its own (the package's
    pyproject options need jaxtyping's and nbval's plugins, which run nothing here)."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        members = [m for m in tar.getmembers() if m.name.startswith(f"{top}/tests/")]
        tar.extractall(into, members=members, filter="data")
    root = into / top
    (root / "pytest.ini").write_text(
        "[pytest]\npythonpath = .\nmarkers =\n    slow: slow\n    inspect: inspect\n"
        "    multigpu: multigpu\n")
    return root


@pytest.mark.slow
def test_transformer_lens_bridge_hook_tests_pass_on_qkv(tmp_path):
    root = _extract(_sdist(), tmp_path)
    calls = tmp_path / "calls"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT / "src")]),
               QKV_TL_CALLS=str(calls))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "transformer_lens_plugin",
         "-p", "no:cacheprovider", "-x", *SELECTED,
         *(arg for test in LEFT_OUT for arg in ("--deselect", test))],
        cwd=root, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
    assert int(calls.read_text()) > 0  # qkv computed the LLaMA bridge's attention
