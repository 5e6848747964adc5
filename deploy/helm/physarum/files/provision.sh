#!/bin/sh
# Fill a directory of the shared models volume once, then write its ready marker (.physarum-ready), which the
# trainer, engine and rollout pods wait for before they start. Run by the chart's fetch Jobs; runs locally too.
#
#   provision.sh KIND SOURCE DEST [REVISION]
#     hf          SOURCE a hub model repo (owner/name), REVISION a branch, tag or commit; HF_TOKEN for gated repos
#     hf-dataset  SOURCE a hub dataset repo
#     s3          SOURCE s3://bucket/prefix of an S3-compatible store (AWS_ENDPOINT_URL, AWS_* keys or workload identity)
#     dir         SOURCE a directory (a volume mounted into the Job, or a local test)
#
# A marker naming the same KIND SOURCE REVISION means the work is done: the script exits at once. Downloads go to
# DEST.partial first (hf and s3 resume what a killed run left there), then replace DEST in one rename.
set -eu
[ $# -ge 3 ] || { echo "usage: provision.sh hf|hf-dataset|s3|dir SOURCE DEST [REVISION]" >&2; exit 2; }
kind=$1 source=$2 dest=${3%/} revision=${4:-}
marker="$dest/.physarum-ready"
stamp="$kind $source $revision"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ]; then
  echo "provision: $dest already holds $stamp"
  exit 0
fi
partial="$dest.partial"
mkdir -p "$partial"
hf_download() {  # the `hf` CLI of huggingface_hub >= 0.34, else its older huggingface-cli
  if command -v hf >/dev/null 2>&1; then hf download "$@"; else huggingface-cli download "$@"; fi
}
echo "provision: $stamp -> $dest"
case $kind in
  hf) hf_download "$source" --revision "${revision:-main}" --local-dir "$partial" ;;
  hf-dataset) hf_download "$source" --repo-type dataset --revision "${revision:-main}" --local-dir "$partial" ;;
  s3) aws s3 sync --only-show-errors "$source" "$partial" ;;
  dir)
    [ -d "$source" ] || { echo "provision: source directory $source does not exist" >&2; exit 1; }
    cp -R "$source/." "$partial/" ;;
  *) echo "provision: unknown kind '$kind' (hf, hf-dataset, s3 or dir)" >&2; exit 2 ;;
esac
rm -rf "$partial/.cache" "$dest"  # hf's download bookkeeping; an older copy
mv "$partial" "$dest"
printf '%s\n' "$stamp" > "$dest/.physarum-ready.tmp"
mv "$dest/.physarum-ready.tmp" "$marker"
echo "provision: $dest ready"
