#!/usr/bin/env bash
# `make images-test`: build the six images and a plugin image with buildah (no daemon), then run
# tests/images/run.py against them. Installs buildah and debootstrap from Debian where they are missing (as root);
# with no way to get a builder it says so and exits 0. Where no container registry is reachable the base image is a
# local stand-in (scripts/images/base.sh); where PyTorch's index is unreachable torch comes through pip's own
# settings here (their CA bundle and wheel folder are mounted into the build, scripts/images/env.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "images-test: installing buildah and debootstrap from Debian"
    apt-get update -qq && apt-get install -y -qq buildah debootstrap >/dev/null
  else
    echo "images-test: skipped: no buildah here and no way to install it (needs root and apt-get)"; exit 0
  fi
fi
# shellcheck source=scripts/images/env.sh
source scripts/images/env.sh
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
base=${PYTHON_IMAGE:-}
if [ -z "$base" ]; then
  pinned=$(sed -n 's/^ARG PYTHON_IMAGE=//p' deploy/docker/buffer.Dockerfile)  # the Dockerfiles' default, by digest
  if timeout 60 buildah pull -q "docker.io/library/$pinned" >/dev/null 2>&1; then
    base=docker.io/library/$pinned
  else
    echo "images-test: no registry reachable: a local base image stands in"
    base=localhost/physarum-base:bookworm
    scripts/images/base.sh "$base"
  fi
fi
torch_index=${TORCH_INDEX_URL:-}
if [ -z "$torch_index" ] && ! timeout 20 "$PY" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=15)" 2>/dev/null; then
  torch_index=https://pypi.org/simple  # with this machine's wheel folder mounted, pip takes its CPU torch first
fi
start=$(date +%s)
make -s images DOCKER=buildah REGISTRY=localhost BUILD_FLAGS="--layers ${BUILD_FLAGS:-}" PYTHON_IMAGE="$base" \
  TORCH_INDEX_URL="$torch_index"
buildah build --layers -q -f deploy/plugins/Dockerfile --build-arg PYTHON_IMAGE="$base" --build-arg PLUGIN_DIR=examples \
  -t "localhost/physarum-plugins-examples:$version" . >/dev/null
echo "images-test: images built in $(( $(date +%s) - start )) s; storage $(du -sh "$IMAGES_DIR/storage" | cut -f1)"
"$PY" -m tests.images.run --registry localhost --version "$version" "$@"
