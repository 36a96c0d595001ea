#!/bin/sh
# `make package`: freeze Reprise with PyInstaller (one folder), then wrap it as an
# AppImage when appimagetool is on PATH, else as a .deb (dpkg-deb, from Debian),
# else a tar.gz with a launcher. Output in dist/. Run from the repository root.
set -eu
PY=${PY:-.venv/bin/python}
VERSION=$($PY -c 'import app; print(app.__version__)')
ARCH=$(uname -m)
DIST=dist
WORK=build/pyinstaller
rm -rf "$DIST/reprise" "$DIST/Reprise.AppDir"
$PY -m PyInstaller --noconfirm --clean --log-level WARN \
  --distpath "$DIST" --workpath "$WORK" packaging/linux/reprise.spec

# The AppDir layout (AppRun, .desktop, icon) serves the AppImage, the .deb and the tarball.
APPDIR="$DIST/Reprise.AppDir"
mkdir -p "$APPDIR/usr/lib" "$APPDIR/usr/share/applications" "$APPDIR/usr/share/icons/hicolor"
cp -a "$DIST/reprise" "$APPDIR/usr/lib/reprise"
cp packaging/linux/AppRun "$APPDIR/AppRun"
chmod +x "$APPDIR/AppRun"
cp packaging/linux/reprise.desktop "$APPDIR/reprise.desktop"
cp packaging/linux/reprise.desktop "$APPDIR/usr/share/applications/reprise.desktop"
cp resources/icons/reprise-256.png "$APPDIR/reprise.png"
for size in 16 32 48 64 128 256 512; do
  mkdir -p "$APPDIR/usr/share/icons/hicolor/${size}x${size}/apps"
  cp "resources/icons/reprise-$size.png" "$APPDIR/usr/share/icons/hicolor/${size}x${size}/apps/reprise.png"
done

if command -v appimagetool >/dev/null 2>&1; then
  ARCH=$ARCH appimagetool "$APPDIR" "$DIST/Reprise-$VERSION-$ARCH.AppImage"
  echo "built $DIST/Reprise-$VERSION-$ARCH.AppImage"
elif command -v dpkg-deb >/dev/null 2>&1; then
  sh packaging/linux/make_deb.sh "$APPDIR" "$VERSION" "$DIST"
else
  tar -C "$DIST" -czf "$DIST/reprise-$VERSION-linux-$ARCH.tar.gz" Reprise.AppDir
  echo "built $DIST/reprise-$VERSION-linux-$ARCH.tar.gz (run Reprise.AppDir/AppRun)"
fi
