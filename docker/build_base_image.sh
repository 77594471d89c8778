#!/usr/bin/env bash
# Builds the local base image (Debian bookworm minbase + Python 3.11) with debootstrap and `docker import`.
# Why: no image registry is reachable here, so `python:3.11-slim-bookworm` cannot be pulled.
# Cached: does nothing when the tag exists with this script's hash as its label.
# Usage: docker/build_base_image.sh [TAG]   (needs root, debootstrap and a running dockerd)
set -euo pipefail
TAG=${1:-${MORPHSERVE_BASE_IMAGE:-morphserve/base:bookworm-py311}}
HERE=$(cd "$(dirname "$0")" && pwd)
want=$(sha256sum "$HERE/build_base_image.sh" | cut -c1-16)
have=$(docker image inspect -f '{{index .Config.Labels "morphserve.base.hash"}}' "$TAG" 2>/dev/null || true)
if [ "$have" = "$want" ]; then echo "[base] $TAG is cached"; exit 0; fi

command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap; }
# Use the mirror apt already uses on this machine (nothing hard-coded); debootstrap's default otherwise.
mirror=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1=="deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)

root=$(mktemp -d /var/tmp/morphserve-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "[base] debootstrap bookworm into $root (mirror: ${mirror:-default})"
# python3.11 + libpython3.11: the Triton Python stub embeds the interpreter; python3-venv for the image's venv.
debootstrap --variant=minbase --include=python3.11,python3-venv,libpython3.11,ca-certificates \
  bookworm "$root" $mirror >/var/tmp/morphserve-debootstrap.log 2>&1 \
  || { tail -30 /var/tmp/morphserve-debootstrap.log; exit 1; }
# Keep the image small: no package caches, lists, docs or man pages.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/var/log/*.log "$root"/tmp/*
tar -C "$root" --numeric-owner -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
  --change "LABEL morphserve.base.hash=$want" - "$TAG" >/dev/null
echo "[base] built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
