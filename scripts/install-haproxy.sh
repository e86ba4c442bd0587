#!/usr/bin/env bash
# Installs HAProxy from Debian's packages when it is missing: the load balancer of the replicas
# tests (tests/tests/balancer.rs, python/tests). Idempotent.
#
# Installing needs root and apt-get. Without them it prints one line and exits 0: the tests that
# need HAProxy then skip themselves, saying so — except under CI=true, where a missing HAProxy
# fails here (exit 1), as it would fail those tests.
set -euo pipefail
found() { command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || [ -x /usr/local/sbin/haproxy ]; }
if found; then
  exit 0
fi
why=""
if [ "$(id -u)" != 0 ]; then
  why="installing it needs root"
elif ! command -v apt-get >/dev/null 2>&1; then
  why="this system has no apt-get"
fi
if [ -n "$why" ]; then
  if [ "${CI:-}" = true ]; then
    echo "haproxy is missing and $why; CI=true requires it (apt-get install haproxy)" >&2
    exit 1
  fi
  echo "haproxy is missing and $why: the load-balancer tests will be skipped (install haproxy to run them)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends haproxy >/dev/null
# The package may start a system service; the tests run their own instances.
(service haproxy stop || true) >/dev/null 2>&1
found
