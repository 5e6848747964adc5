# Sourced by `make images-test`: daemonless buildah settings under IMAGES_DIR (default .physarum/images), kept out of
# the user's own container storage. vfs storage (no overlay or fuse needed) and chroot isolation (no runc or crun
# needed). When this machine's pip is set up with a CA bundle or a local wheel folder (find-links), the same settings
# are bind-mounted into every RUN step, so pip inside the build reaches what pip here reaches; nothing lands in the
# images.
IMAGES_DIR=${IMAGES_DIR:-$PWD/.physarum/images}
mkdir -p "$IMAGES_DIR/storage" "$IMAGES_DIR/run"
cat > "$IMAGES_DIR/storage.conf" <<CONF
[storage]
driver = "vfs"
graphroot = "$IMAGES_DIR/storage"
runroot = "$IMAGES_DIR/run"
CONF
volumes=""
pip_conf="$IMAGES_DIR/pip.conf"
printf '[global]\n' > "$pip_conf"
pip_setting() {  # the value pip here uses for $1 (from its config files or PIP_* variables), or nothing
  python3 -m pip config list 2>/dev/null | sed -n "s/^\(global\|:env:\)\.$1='\([^' ]*\).*/\2/p" | head -n1
}
cert=$(pip_setting cert)
if [ -n "$cert" ] && [ -f "$cert" ]; then
  volumes="$volumes \"$cert:/etc/ssl/certs/host-ca.crt:ro\","
  printf 'cert = /etc/ssl/certs/host-ca.crt\n' >> "$pip_conf"
fi
links=$(pip_setting find-links)
if [ -n "$links" ] && [ -d "$links" ]; then
  volumes="$volumes \"$links:/opt/host-wheels:ro\","
  printf 'find-links = /opt/host-wheels\n' >> "$pip_conf"
fi
volumes="$volumes \"$pip_conf:/etc/pip.conf:ro\""
cat > "$IMAGES_DIR/containers.conf" <<CONF
[containers]
volumes = [$volumes]
CONF
export IMAGES_DIR CONTAINERS_STORAGE_CONF="$IMAGES_DIR/storage.conf" CONTAINERS_CONF="$IMAGES_DIR/containers.conf"
export BUILDAH_ISOLATION=chroot
