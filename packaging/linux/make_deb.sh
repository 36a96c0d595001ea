#!/bin/sh
# A .deb from the AppDir: the bundle in /opt/reprise, `reprise` on PATH, the
# .desktop file and icons where desktops look. Usage: make_deb.sh APPDIR VERSION OUTDIR
set -eu
APPDIR=$1; VERSION=$2; OUT=$3
ARCH=$(dpkg --print-architecture)
ROOTFS="$OUT/deb-root"
rm -rf "$ROOTFS"
mkdir -p "$ROOTFS/DEBIAN" "$ROOTFS/opt" "$ROOTFS/usr/bin" "$ROOTFS/usr/share"
cp -a "$APPDIR" "$ROOTFS/opt/reprise"
ln -s /opt/reprise/AppRun "$ROOTFS/usr/bin/reprise"
cp -a "$APPDIR/usr/share/applications" "$APPDIR/usr/share/icons" "$ROOTFS/usr/share/"
SIZE_KB=$(du -sk "$ROOTFS" | cut -f1)
# Recommends: replies hold emoji, which Qt draws as empty boxes without a colour emoji font
# (a minimal Debian or Ubuntu has none; a new-user walk saw the boxes).
cat > "$ROOTFS/DEBIAN/control" <<CONTROL
Package: reprise
Version: $VERSION
Architecture: $ARCH
Maintainer: Reprise developers <reprise@reprise.app>
Installed-Size: $SIZE_KB
Depends: libegl1, libgl1, libfontconfig1, libdbus-1-3, libxkbcommon0, libxkbcommon-x11-0, libxcb-cursor0, libxcb-icccm4, libxcb-keysyms1, libxcb-shape0, libxcb-render-util0, libxcb-image0
Recommends: fonts-noto-color-emoji
Section: utils
Priority: optional
Homepage: https://reprise.app
Description: Desktop chat for local language models on MLX
 Conversations you reopen continue instantly: the model's KV cache is saved
 to disk. The first start offers to import a starter model (a GGUF file).
CONTROL
# gzip, not the default xz: 4x faster to build on a small machine, and every dpkg reads it.
dpkg-deb --root-owner-group -Zgzip -z6 --build "$ROOTFS" "$OUT/reprise_${VERSION}_${ARCH}.deb" >/dev/null
rm -rf "$ROOTFS"
echo "built $OUT/reprise_${VERSION}_${ARCH}.deb"
