"""Fixtures shared across the test folders, and the order the files run in."""

import functools

import pytest

import qkv.models
import qkv.threads


@pytest.fixture(autouse=True, scope="session")
def idle_machine():
    """Commands run on fewer threads while other jobs load the machine, and say so on stderr
    (qkv.threads). In-process tests see an idle machine, so that what a command prints does
    not depend on the jobs beside it (tests/test_threads.py sets the load it tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qkv.threads, "load_average", lambda: 0.0)
        yield


@pytest.fixture(scope="module")
def load_pretrained_once():
    """Commands load checkpoints through qkv.models.load_pretrained: within a module, load each
    one once (tests must not pack or otherwise change the models they get)."""
    original = qkv.models.load_pretrained
    qkv.models.load_pretrained = functools.lru_cache(maxsize=None)(original)
    yield
    qkv.models.load_pretrained = original


# `make test` runs the files on pytest-xdist workers (--dist loadfile), handed out in
# collection order. These go first, longest first (seconds of a cold run, fresh Triton and
# inductor caches, on a 2-core Zen 4, 2026-12; the browser files from a run with Chromium),
# so that no worker is left running one of them alone at the end; the rest keep their order.
LONG_FILES = (
    "tests/core/test_triton_compile.py",  # 170: sm_90 builds with the bundled ptxas
    "tests/core/test_triton_engine.py",  # 45: the whole interpreter matrix, one subprocess
    "tests/distributed/test_fsdp.py",  # 80
    "tests/models/test_gpt.py",  # 55: inductor compiling a training step
    "tests/viz/test_notebook.py",  # 40: a real notebook kernel, MiniLM, Chromium
    "tests/core/test_native_targets.py",  # 40: the C kernels built for three x86 levels
    "tests/distributed/test_context_parallel_weightings.py",  # 37
    "tests/integrations/test_transformers_compile_stable.py",  # 37
    "tests/integrations/test_transformer_lens_suite.py",  # 35
    "tests/viz/test_serve.py",  # 35: 8,192 tokens served, Chromium, the command
    "tests/core/test_compile.py",  # 35
    "tests/distributed/test_train.py",  # 32
    "tests/test_readme.py",  # 29: the README's commands, each loading a real checkpoint
    "tests/distributed/test_context_parallel.py",  # 28
    "tests/core/test_fresh_processes.py",  # 26
    "tests/test_cli_models.py",  # 26
    "tests/train/test_init.py",  # 24
    "tests/models/test_pretrained_llama.py",  # 24
    "tests/test_chat_terminal.py",  # 23
    "tests/lab/test_lab.py",  # 17
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)
