#!/usr/bin/env bash
# Makes sure a headless Chromium is there for the report's browser test: Debian's chromium-headless-shell,
# installed as root where apt-get exists (the test drives it through Playwright's Python package).
# Usage: workflow/scripts/browser.sh
set -euo pipefail
for b in "${ORPO_CHROMIUM:-}" chromium-headless-shell chromium chromium-browser google-chrome; do
  [ -n "$b" ] && command -v "$b" >/dev/null 2>&1 && exit 0
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "browser: installing headless Chromium (apt-get install chromium-headless-shell)"
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium-headless-shell >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium-headless-shell >/dev/null 2>&1; }) \
    && exit 0
  echo "browser: could not install chromium-headless-shell" >&2
fi
echo "browser: no headless Chromium found; the report's browser test needs one (or ORPO_CHROMIUM=/path/to/chrome)" >&2
