#!/bin/sh
# On macOS 14+ (Apple silicon): freeze Reprise into dist/Reprise.app, then sign,
# notarize and wrap it in a DMG when the signing variables are set (sign_notarize.sh).
set -eu
[ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ] || { echo "macOS on Apple silicon only"; exit 1; }
PY=${PY:-.venv/bin/python}
# mlx wheels are built per macOS release; pin the oldest one the app supports so the
# bundle runs on every macOS 14+, not only the build machine's release.
PYV=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
rm -rf build/mlx-wheel
$PY -m pip download -q --only-binary=:all: --platform macosx_14_0_arm64 --python-version "$PYV" \
  mlx==0.32.4 -d build/mlx-wheel
$PY -m pip install -q --no-deps --force-reinstall build/mlx-wheel/*.whl
sh packaging/macos/make_icns.sh
$PY -m PyInstaller --noconfirm --clean --distpath dist --workpath build/pyinstaller packaging/macos/reprise.spec
test -f dist/Reprise.app/Contents/Frameworks/mlx/lib/mlx.metallib || \
  test -n "$(find dist/Reprise.app -name mlx.metallib)" || { echo "mlx.metallib missing from the bundle"; exit 1; }
# A frozen smoke check: the bundled interpreter reaches Metal and the resources.
dist/Reprise.app/Contents/MacOS/Reprise --version
if [ -n "${MACOS_SIGN_IDENTITY:-}" ]; then
  sh packaging/macos/sign_notarize.sh dist/Reprise.app
else
  hdiutil create -volname Reprise -srcfolder dist/Reprise.app -ov -format UDZO dist/Reprise-unsigned.dmg
fi
