#!/bin/sh
# `make pipx-test`: the built wheel installed by pipx into a temporary PIPX_HOME (pipx
# itself in a temporary venv), then the app started with a clean environment and a
# fresh HOME: first-start import of the starter GGUF from ~/Downloads, one turn, exit 0.
set -eu
GGUF=$1
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
python3 -m venv "$W/tool"
"$W/tool/bin/pip" install -q pipx
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation . -w "$W/dist"
PIPX_HOME="$W/pipx" PIPX_BIN_DIR="$W/bin" "$W/tool/bin/pipx" install "$W"/dist/reprise_chat-*.whl
mkdir -p "$W/home/Downloads" "$W/shots"
cp "$GGUF" "$W/home/Downloads/"
cd "$W"
env -i HOME="$W/home" PATH=/usr/bin:/bin "$W/bin/reprise" --version
env -i HOME="$W/home" PATH=/usr/bin:/bin QT_QPA_PLATFORM=offscreen REPRISE_SMOKE="$W/shots" \
  "$W/bin/reprise" | grep '"smoke": "ok"' >/dev/null
echo "pipx-test: passed"
