#!/bin/sh
# Prints the first OCI image builder that can build here: Docker with a running engine, else Podman, else buildah
# (both daemonless); prints nothing when there is none. `make images` uses it when DOCKER is not set.
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker; exit 0; fi
for builder in podman buildah; do
  if command -v "$builder" >/dev/null 2>&1; then echo "$builder"; exit 0; fi
done
