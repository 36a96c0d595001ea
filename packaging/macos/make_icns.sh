#!/bin/sh
# build/Reprise.icns from the committed PNGs (resources/icons, made from the SVG by
# packaging/make_icons.sh) with iconutil, which ships with macOS.
set -eu
ICONS=resources/icons
SET=build/Reprise.iconset
rm -rf "$SET"; mkdir -p "$SET"
for size in 16 32 128 256 512; do
  cp "$ICONS/reprise-$size.png" "$SET/icon_${size}x${size}.png"
  cp "$ICONS/reprise-$((size * 2)).png" "$SET/icon_${size}x${size}@2x.png"
done
iconutil -c icns "$SET" -o build/Reprise.icns
echo "built build/Reprise.icns"
