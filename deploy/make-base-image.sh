#!/bin/sh
# Make a Debian base image for the Xronos Dockerfile without a registry:
#   deploy/make-base-image.sh NAME
# debootstrap (minbase + python3, python3-venv, python3-pip, ca-certificates)
# from the Debian mirror this machine's apt uses, then `docker import`. Build
# the image on it with --build-arg BASE_IMAGE=NAME (deploy/README.md).
#
# The root filesystem tarball is kept in $XRONOS_CACHE (default
# /var/cache/xronos-smoke): a second call only imports it (seconds; debootstrap
# takes ~45 s). Needs root and debootstrap. Environment:
#   XRONOS_DEBIAN_MIRROR  the mirror (default: the first Debian one apt uses)
#   XRONOS_DEBIAN_SUITE   default bookworm (Python 3.11)
set -eu
name=${1:?usage: make-base-image.sh NAME}
suite=${XRONOS_DEBIAN_SUITE:-bookworm}
cache=${XRONOS_CACHE:-/var/cache/xronos-smoke}
arch=$(dpkg --print-architecture)
tarball="$cache/base-$suite-$arch.tar"

apt_mirror() {
  # deb822 sources (URIs: ...) first, then one-line sources (deb URL suite ...); not the security archive
  { cat /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -n 's/^URIs:[[:space:]]*//p' | tr ' ' '\n'
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p'
  } | grep -v -e security -e '^$' | head -n 1
}

mkdir -p "$cache"
exec 9>"$cache/.base.lock"
flock 9  # one debootstrap at a time per cache
if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || { echo "make-base-image: debootstrap is not installed (apt-get install --no-install-recommends debootstrap)" >&2; exit 1; }
  mirror=${XRONOS_DEBIAN_MIRROR:-$(apt_mirror)}
  mirror=${mirror:-http://deb.debian.org/debian}
  root=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$root" "$tarball.tmp"' EXIT
  echo "make-base-image: debootstrap $suite ($arch) from $mirror" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$suite" "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
    || { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
  # what an image does not need: downloaded packages and package lists
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* "$root"/var/log/*.log
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
docker import --change 'CMD ["/bin/bash"]' "$tarball" "$name" >/dev/null
echo "make-base-image: $name from $tarball" >&2
