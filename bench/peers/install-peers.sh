#!/usr/bin/env bash
# Run on the GPU machine, from the repo root, after the kit's eval line (so PYTHONPATH already names the kit):
#
#     eval "$(bash .carry/gpu-tools/install-on-device.sh)"; eval "$(bash bench/peers/install-peers.sh)"
#
# Unpacks .carry/peers/peers.tar.xz (built by bench/peers/fetch-peer-wheels.sh: trl, accelerate, datasets, pyarrow,
# pandas, ..., openrlhf, peft, torchdata) into /tmp/site/peers, installing only the distributions that the environment
# (image + kit) lacks or has below the minimum TRL / datasets need, with `pip install --no-index --no-deps --target`.
# stdout carries only `export` lines that APPEND /tmp/site/peers after the kit's paths, so the image's and the kit's
# packages (numpy, torch, transformers, ...) are never shadowed by ours; progress goes to stderr.
# Idempotent: a marker keyed by the bundle's sha256 makes a second run print the exports only (< 0.1 s). The install
# needs .carry/peers only once per warm machine (the folder may be left out of later transfers).
# Env: PEERS_CARRY_DIR (.carry/peers), PEERS_SITE (/tmp/site/peers), PYTHON (python3),
#      PEERS_FORCE="dist dist" installs those even when present, PEERS_PIP (the pip to run: "$PYTHON -m pip"),
#      PEERS_PIP_ARGS extra pip arguments (tests on another Python: --python-version 3.12 --platform ...).
set -uo pipefail
CARRY=${PEERS_CARRY_DIR:-.carry/peers}
SITE=${PEERS_SITE:-/tmp/site/peers}
PY=${PYTHON:-python3}
log() { echo "[peers-install] $*" >&2; }
t0=$(date +%s%N)

exports() {
  echo "export PYTHONPATH=\${PYTHONPATH:+\$PYTHONPATH:}$SITE"
  echo "export PATH=\$PATH:$SITE/bin"
  echo "export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled"
}

marker_glob=("$SITE"/.installed-*)
if [ ! -f "$CARRY/MANIFEST" ]; then
  if [ -f "${marker_glob[0]}" ]; then
    log "already installed ($(basename "${marker_glob[0]}")); no $CARRY this time"
    exports; exit 0
  fi
  log "no $CARRY/MANIFEST and nothing installed in $SITE: send .carry/peers (bash bench/peers/fetch-peer-wheels.sh)"
  exit 1
fi
read -r _ _ bsha bsize < <(grep '^bundle ' "$CARRY/MANIFEST")
marker="$SITE/.installed-$bsha"
if [ -f "$marker" ]; then
  log "already installed ($(( ($(date +%s%N) - t0) / 1000000 )) ms)"
  exports; exit 0
fi
if [ "$(stat -c %s "$CARRY/peers.tar.xz" 2>/dev/null)" != "$bsize" ] \
   || [ "$(sha256sum "$CARRY/peers.tar.xz" | cut -d' ' -f1)" != "$bsha" ]; then
  log "$CARRY/peers.tar.xz is missing or does not match its MANIFEST (sha256 $bsha, $bsize bytes)"
  exit 1
fi

# which wheels to install: a distribution the environment has (at or above the minimum) is left alone
wanted=$(PEERS_FORCE="${PEERS_FORCE:-}" "$PY" - "$CARRY/MANIFEST" <<'PYEOF'
import os, re, sys
from importlib import metadata

# minimums of trl 1.16.0 / datasets 4.8.5 / pandas 2.3.3; an older copy in the image would break them
MINIMUM = {"accelerate": "1.10.1", "datasets": "4.7.0", "pyarrow": "21.0.0", "pandas": "2.1.1",
           "fsspec": "2023.1.0", "python_dateutil": "2.8.2", "trl": "1.16.0", "peft": "0.13.0"}
force = set(os.environ.get("PEERS_FORCE", "").replace("-", "_").lower().split())

def key(version):
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])

for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) != 4 or parts[0] == "bundle":
        continue
    name, version, wheel, _ = parts
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if name in force:
        why = "forced"
    elif have is None:
        why = "missing"
    elif name in MINIMUM and key(have) < key(MINIMUM[name]):
        why = f"present {have} < {MINIMUM[name]}"
    else:
        print(f"skip {name} (present: {have}; carried {version})", file=sys.stderr)
        continue
    print(f"add  {name} {version} ({why})", file=sys.stderr)
    print(wheel)
PYEOF
) || { log "checking the environment failed"; exit 1; }

tmp=$(mktemp -d /tmp/peers-x.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$SITE"; mkdir -p "$SITE"
if [ -n "$wanted" ]; then
  members=$(sed 's|^|wheels/|' <<< "$wanted")
  # shellcheck disable=SC2086
  if ! (if command -v xz >/dev/null 2>&1; then xz -dc -T0 "$CARRY/peers.tar.xz"; else
          "$PY" -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1<<20)' \
            "$CARRY/peers.tar.xz"; fi) | tar -x -C "$tmp" $members; then
    log "unpacking $CARRY/peers.tar.xz failed"; exit 1
  fi
  # shellcheck disable=SC2086
  if ! PIP_ROOT_USER_ACTION=ignore ${PEERS_PIP:-"$PY" -m pip} install -q --no-index --no-deps --no-compile \
        --no-cache-dir --disable-pip-version-check \
        ${PEERS_PIP_ARGS:-} --target "$SITE" "$tmp"/wheels/*.whl >&2; then
    log "pip install failed"; exit 1
  fi
fi
touch "$marker"
log "installed $(wc -w <<< "$wanted") wheel(s) into $SITE in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
exports
