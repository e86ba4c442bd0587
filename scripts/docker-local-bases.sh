#!/usr/bin/env bash
# Makes local stand-ins for the Docker Hub base images that docker/Dockerfile and
# docker/compose.yaml name, on a machine that reaches Debian's archive but not Docker Hub, so
# that scripts/check-images.sh and `docker compose` can build and run the images there:
#   debian:bookworm-slim   debootstrap's minbase of bookworm (main, updates, security)
#   rust:1-slim-bookworm   that, plus gcc, libc6-dev and ca-certificates (as the official image's
#                          Dockerfile installs them) and this machine's Rust toolchain under
#                          /usr/local/rustup, with the official image's RUSTUP_HOME, CARGO_HOME
#                          and PATH
#   haproxy:2.6            that, plus Debian's haproxy (2.6 in bookworm), run as the official
#                          image runs it (`haproxy -f /usr/local/etc/haproxy/haproxy.cfg`, SIGUSR1
#                          to stop)
# An image already present under a name is left as it is (a pulled official one stays). Each
# stand-in carries the label xdistill.stand-in=<what it replaces>. CA certificates this machine
# trusts beyond Debian's (/usr/local/share/ca-certificates: a TLS proxy's, say) go into the Rust
# image, or cargo could not fetch crates through that proxy.
#
#   sudo scripts/docker-local-bases.sh     # needs root (debootstrap), docker and a running daemon
#
# With Debian's docker.io (20.10; its client has BuildKit built in, which the Dockerfiles'
# cache mounts need): `apt-get install docker.io debootstrap docker-compose`, `dockerd &`, and
# put /usr/bin first on PATH if a newer client without the buildx plugin comes first.
set -euo pipefail
command -v docker >/dev/null || { echo "docker-local-bases: no docker client" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "docker-local-bases: no Docker daemon reachable" >&2; exit 1; }
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have debian:bookworm-slim; then
  command -v debootstrap >/dev/null || { echo "docker-local-bases: install debootstrap" >&2; exit 1; }
  echo "debian:bookworm-slim: debootstrap (minbase) from $mirror" >&2
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  printf '%s\n' "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb ${mirror%/debian}/debian-security bookworm-security main" > "$work/rootfs/etc/apt/sources.list"
  rm -rf "$work/rootfs"/var/lib/apt/lists/* "$work/rootfs"/var/cache/apt/*.bin
  tar -C "$work/rootfs" -c . | docker import \
    -c 'CMD ["bash"]' -c 'LABEL xdistill.stand-in=docker.io/library/debian:bookworm-slim' \
    - debian:bookworm-slim >/dev/null
  rm -rf "$work/rootfs"
fi

if ! have rust:1-slim-bookworm; then
  sysroot=$(rustc --print sysroot)
  echo "rust:1-slim-bookworm: debian:bookworm-slim + $(rustc --version) from $sysroot" >&2
  ctx="$work/rust"
  mkdir -p "$ctx/certs" "$ctx/tc"
  cp -a "$sysroot"/bin "$sysroot"/lib "$ctx/tc/"
  [ -d "$sysroot/libexec" ] && cp -a "$sysroot/libexec" "$ctx/tc/"
  rm -rf "$ctx/tc/lib/rustlib/src" "$ctx/tc/lib/rustlib/rustc-src"
  cp /usr/local/share/ca-certificates/*.crt "$ctx/certs/" 2>/dev/null || true
  cat > "$ctx/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
LABEL xdistill.stand-in=docker.io/library/rust:1-slim-bookworm
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY certs/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
COPY tc /usr/local/rustup/toolchains/stable
RUN mkdir -p /usr/local/cargo/bin \
    && for b in cargo rustc rustdoc; do ln -s ../../rustup/toolchains/stable/bin/$b /usr/local/cargo/bin/$b; done \
    && cargo --version && rustc --version
EOF
  docker build -q --network host -t rust:1-slim-bookworm "$ctx" >/dev/null
fi

if ! have haproxy:2.6; then
  echo "haproxy:2.6: debian:bookworm-slim + Debian's haproxy" >&2
  mkdir -p "$work/haproxy"
  cat > "$work/haproxy/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
LABEL xdistill.stand-in=docker.io/library/haproxy:2.6
RUN apt-get update && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /usr/local/etc/haproxy
STOPSIGNAL SIGUSR1
USER haproxy
CMD ["haproxy", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
EOF
  docker build -q --network host -t haproxy:2.6 "$work/haproxy" >/dev/null
fi
docker image ls --filter label=xdistill.stand-in \
  --format '{{.Repository}}:{{.Tag}}  {{.Size}}  (a local stand-in)' >&2
