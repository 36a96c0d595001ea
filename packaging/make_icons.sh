#!/bin/sh
# PNG icons from resources/icons/reprise.svg with rsvg-convert (Debian: librsvg2-bin).
# Linux (hicolor) wants 16..512; macOS's iconset wants 16..1024 (packaging/macos/make_icns.sh
# builds the .icns from these with iconutil). The PNGs are committed; rerun after editing the SVG.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
icons="$here/resources/icons"
for size in 16 32 48 64 128 256 512 1024; do
  rsvg-convert -w "$size" -h "$size" "$icons/reprise.svg" -o "$icons/reprise-$size.png"
done
