#!/usr/bin/env bash
# Run on the GPU machine, from the repo root, at the start of every command there (after the GPU kit's eval line):
#
#     eval "$(bash .carry/sglang-tools/install-sglang.sh)"
#
# Copies the parts of the SGLang bundle (built by bench/peers/fetch-sglang-wheels.sh) that this or an earlier transfer
# sent (.carry/sglangN/) into a stash that outlives the command while the machine stays warm (/tmp/sglang-stash), and
# once every part is there installs the wheels with `pip install --no-index --no-deps --target /tmp/site/sglang`.
# SGLang's site directory is NOT put on this shell's PYTHONPATH (its pins would shadow vLLM's kit): stdout carries one
# export, RLHFKIT_SGLANG_SITE, which the engine passes to the server (SGLangEngineConfig(env={"PYTHONPATH": ...})).
# Idempotent: a marker keyed by the bundle's sha256 makes a later run print the export only.
# Env: SGLANG_CARRY_DIR (.carry), SGLANG_STASH (/tmp/sglang-stash), SGLANG_SITE (/tmp/site/sglang), PYTHON (python3).
set -uo pipefail
CARRY=${SGLANG_CARRY_DIR:-.carry}
STASH=${SGLANG_STASH:-/tmp/sglang-stash}
SITE=${SGLANG_SITE:-/tmp/site/sglang}
PY=${PYTHON:-python3}
log() { echo "[sglang-install] $*" >&2; }
t0=$(date +%s%N)
mkdir -p "$STASH"
for d in "$CARRY"/sglang[0-9]*/; do
  [ -d "$d" ] || continue
  for f in "$d"*; do
    [ -f "$f" ] || continue
    b=$(basename "$f")
    if [ ! -f "$STASH/$b" ] || ! cmp -s "$f" "$STASH/$b"; then cp -f "$f" "$STASH/$b.tmp" && mv -f "$STASH/$b.tmp" "$STASH/$b"; fi
  done
done
if [ ! -f "$STASH/MANIFEST" ]; then log "no MANIFEST in $CARRY/sglang*/ or $STASH: send .carry/sglang1 first"; exit 1; fi
read -r _ _ bsha _ _ < <(grep '^bundle ' "$STASH/MANIFEST")
if [ ! -f "$SITE/.installed-$bsha" ]; then
  files=(); missing=()
  while read -r kind _ _ pfile psha _ chunk; do
    [ "$kind" = part ] || continue
    if [ -f "$STASH/$pfile" ] && [ "$(sha256sum "$STASH/$pfile" | cut -d' ' -f1)" = "$psha" ]; then files+=("$STASH/$pfile")
    else missing+=("$chunk"); fi
  done < "$STASH/MANIFEST"
  if [ ${#missing[@]} -gt 0 ]; then log "waiting for ${missing[*]}"; echo "export RLHFKIT_SGLANG_SITE="; exit 1; fi
  rm -rf "$STASH/x" "$SITE"; mkdir -p "$STASH/x"
  if ! cat "${files[@]}" | xz -dc -T0 | tar -x -C "$STASH/x"; then log "unpacking failed"; exit 1; fi
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" "$STASH/x"/wheels/*.whl >&2; then log "pip install failed"; exit 1; fi
  rm -rf "$STASH/x"; touch "$SITE/.installed-$bsha"
  log "installed into $SITE in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
fi
echo "export RLHFKIT_SGLANG_SITE=$SITE"
