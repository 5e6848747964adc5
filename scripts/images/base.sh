#!/usr/bin/env bash
# The stand-in base image where no container registry is reachable: Debian bookworm (Python 3.11, the Python the
# images' constraints were made on) from debootstrap, imported into buildah's storage as $1 (default
# localhost/physarum-base:bookworm). Reused when it is there. Needs root, debootstrap and buildah (env.sh sourced).
set -euo pipefail
name=${1:-localhost/physarum-base:bookworm}
if buildah inspect --type image "$name" >/dev/null 2>&1; then echo "base image $name: reused"; exit 0; fi
mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p; s/^deb \(http[^ ]*debian\) bookworm .*/\1/p' \
  /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -n1 || true)
mirror=${mirror:-http://deb.debian.org/debian}
rootfs="$IMAGES_DIR/rootfs"
rm -rf "$rootfs"
echo "base image $name: debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,netbase,tzdata \
  bookworm "$rootfs" "$mirror" >"$IMAGES_DIR/debootstrap.log" 2>&1 || { tail -20 "$IMAGES_DIR/debootstrap.log"; exit 1; }
rm -rf "$rootfs/var/cache/apt/archives"/*.deb "$rootfs/var/lib/apt/lists"/*
ctr=$(buildah from scratch)
mnt=$(buildah mount "$ctr")
cp -a "$rootfs/." "$mnt/"
buildah umount "$ctr" >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
  --cmd python3 "$ctr"
buildah commit -q "$ctr" "$name" >/dev/null
buildah rm "$ctr" >/dev/null
rm -rf "$rootfs"
echo "base image $name: built"
