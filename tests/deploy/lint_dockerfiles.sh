#!/usr/bin/env bash
# Lints deploy/docker/Dockerfile*, which cannot be built where there is no Docker engine,
# with dockerfile-utils (the Dockerfile language service's linter, from npm). Its version
# and those of its dependencies are pinned, with integrity hashes, by
# tests/deploy/dockerfile-lint/package-lock.json; `npm ci` installs them into TOOLS_DIR.
# Usage: lint_dockerfiles.sh TOOLS_DIR  (run from the repository root)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:?usage: lint_dockerfiles.sh TOOLS_DIR}
lint="$dest/node_modules/.bin/dockerfile-utils"

if ! cmp -s "$here/dockerfile-lint/package-lock.json" "$dest/package-lock.json" || [ ! -x "$lint" ]; then
  command -v npm >/dev/null 2>&1 || {
    echo "lint_dockerfiles: npm not found; scripts/install-deps.sh installs it" >&2
    exit 1
  }
  mkdir -p "$dest"
  cp "$here/dockerfile-lint/package.json" "$here/dockerfile-lint/package-lock.json" "$dest/"
  (cd "$dest" && npm ci --silent --no-audit --no-fund --cache "$dest/npm-cache") || {
    echo "lint_dockerfiles: npm ci failed (is the npm registry reachable?)" >&2
    exit 1
  }
  rm -rf "$dest/npm-cache"
fi

status=0
for dockerfile in deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda; do
  if out=$("$lint" lint "$dockerfile" 2>&1) && [ -z "$out" ]; then
    echo "ok: $dockerfile"
  else
    echo "FAIL: $dockerfile"
    echo "$out"
    status=1
  fi
done
exit $status
