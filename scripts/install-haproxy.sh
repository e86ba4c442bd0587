#!/usr/bin/env bash
# Installs HAProxy from Debian's packages when it is missing (the load balancer the loopback
# balancer test runs, tests/tests/balancer.rs). Idempotent; needs root (as CI's machine is).
set -euo pipefail
if command -v haproxy >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "haproxy is missing and installing it needs root: apt-get install haproxy" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends haproxy >/dev/null
# The package may start a system service; the tests run their own instances.
(service haproxy stop || true) >/dev/null 2>&1
command -v haproxy >/dev/null
