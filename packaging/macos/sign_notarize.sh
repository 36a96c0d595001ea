#!/bin/sh
# Sign every nested binary (innermost first), then the app, with the hardened
# runtime; build a DMG, sign it, notarize it and staple the ticket.
# Needs: MACOS_SIGN_IDENTITY ("Developer ID Application: …"), and for notarytool
# either MACOS_NOTARY_PROFILE (a keychain profile from `xcrun notarytool
# store-credentials`) or APPLE_ID, APPLE_TEAM_ID and APPLE_APP_PASSWORD.
set -eu
APP=$1
ENT=packaging/macos/entitlements.plist
VERSION=$(/usr/libexec/PlistBuddy -c "Print CFBundleShortVersionString" "$APP/Contents/Info.plist")
DMG="dist/Reprise-$VERSION-arm64.dmg"
sign() { codesign --force --timestamp --options runtime --entitlements "$ENT" --sign "$MACOS_SIGN_IDENTITY" "$1"; }
# Nested code: dylibs, .so modules, the metallib's neighbours, Qt frameworks' binaries.
find "$APP/Contents" -type f \( -name '*.dylib' -o -name '*.so' -o -perm -111 \) ! -path '*/MacOS/Reprise' |
  while read -r binary; do
    if file "$binary" | grep -q 'Mach-O'; then sign "$binary"; fi
  done
find "$APP/Contents" -type d -name '*.framework' | sort -r | while read -r framework; do sign "$framework"; done
sign "$APP"
codesign --verify --deep --strict --verbose=2 "$APP"
rm -f "$DMG"
hdiutil create -volname Reprise -srcfolder "$APP" -ov -format UDZO "$DMG"
codesign --force --timestamp --sign "$MACOS_SIGN_IDENTITY" "$DMG"
if [ -n "${MACOS_NOTARY_PROFILE:-}" ]; then
  xcrun notarytool submit "$DMG" --keychain-profile "$MACOS_NOTARY_PROFILE" --wait
else
  xcrun notarytool submit "$DMG" --apple-id "$APPLE_ID" --team-id "$APPLE_TEAM_ID" \
    --password "$APPLE_APP_PASSWORD" --wait
fi
xcrun stapler staple "$DMG"
spctl --assess --type open --context context:primary-signature --verbose "$DMG"
echo "built $DMG"
