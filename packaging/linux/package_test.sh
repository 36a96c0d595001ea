#!/bin/sh
# `make package-test`: the built .deb (or AppDir) started as a user would, with
# nothing of the checkout: env -i, a fresh HOME, no venv on PATH, under Xvfb.
# The starter GGUF lies in ~/Downloads as a user would have it; the first start
# imports it with a progress bar, one turn is chatted (REPRISE_SMOKE drives the
# window), the app quits with 0. Screenshots go to dist/package-test/.
set -eu
GGUF=$1
DIST=$(pwd)/dist
SHOTS="$DIST/package-test"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
DEB=$(ls "$DIST"/reprise_*.deb 2>/dev/null | tail -n 1 || true)
if [ -n "$DEB" ]; then
  dpkg-deb -x "$DEB" "$WORK/root"   # unpacked, not installed: the machine is left alone
  dpkg-deb -f "$DEB" Recommends | grep -q fonts-noto-color-emoji || {
    echo "package-test: the .deb does not recommend an emoji font"; exit 1; }
  LAUNCHER="$WORK/root/opt/reprise/AppRun"
else
  LAUNCHER="$DIST/Reprise.AppDir/AppRun"
fi
mkdir -p "$WORK/home/Downloads" "$WORK/run"
chmod 700 "$WORK/run"
cp "$GGUF" "$WORK/home/Downloads/"
rm -rf "$SHOTS"; mkdir -p "$SHOTS"
cd "$WORK"
set +e
env -i HOME="$WORK/home" PATH=/usr/bin:/bin LANG=C.UTF-8 XDG_RUNTIME_DIR="$WORK/run" \
  REPRISE_SMOKE="$SHOTS" \
  timeout 600 xvfb-run -a -s "-screen 0 1280x800x24" "$LAUNCHER" >"$SHOTS/stdout.txt" 2>"$SHOTS/stderr.txt"
status=$?
set -e
cat "$SHOTS/stdout.txt"
[ $status -eq 0 ] || { echo "package-test: the app exited with $status"; tail -20 "$SHOTS/stderr.txt"; exit 1; }
grep -q '"smoke": "ok"' "$SHOTS/stdout.txt" || { echo "package-test: no finished turn"; exit 1; }
for shot in 1-first-run 2-importing 3-ready 4-reply; do
  [ -s "$SHOTS/$shot.png" ] || { echo "package-test: no screenshot $shot"; exit 1; }
done
# The model and the chat went where platformdirs (and Qt) say, in the fresh HOME.
[ -f "$WORK/home/.local/share/Reprise/models/SmolLM2-135M-Instruct/config.json" ] || {
  echo "package-test: the starter model is not in ~/.local/share/Reprise/models"; exit 1; }
echo "package-test: passed (screenshots in $SHOTS)"
