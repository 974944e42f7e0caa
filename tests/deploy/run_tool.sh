#!/usr/bin/env bash
# Runs a command-line tool that a Debian package provides, or says which package to install.
# Usage: run_tool.sh DEBIAN_PACKAGE TOOL [ARGS...]
set -euo pipefail
package=$1 tool=$2
shift 2
if ! command -v "$tool" >/dev/null 2>&1; then
  echo "$tool not found: install the Debian package $package (scripts/install-deps.sh)" >&2
  exit 1
fi
exec "$tool" "$@"
