#!/usr/bin/env bash
# Build .carry/sglang1, .carry/sglang2, ...: sglang 0.5.17 and what it needs beyond the GPU machine's image (Python
# 3.12, torch 2.11.0+cu130 with its CUDA libraries and triton, a CUDA toolkit), as cp312 manylinux x86_64 wheels,
# slimmed to Hopper (sm_90) kernels, in one xz bundle split into transfer chunks of <= SGLANG_CHUNK_MIB.
# Run on a networked machine, from the repo root (../shared/gpu/pack.py lies beside it):
#
#     bash bench/peers/fetch-sglang-wheels.sh
#
# SGLang gets a site directory of its own on the device (/tmp/site/sglang, by bench/peers/install-sglang.sh): it pins
# transformers 5.12.1, flashinfer 0.6.15.post1 and others that vLLM 0.22.1's kit pins differently, so the two never
# share a PYTHONPATH; rlhfkit's SGLang engine starts the server with SGLangEngineConfig(env={"PYTHONPATH": ...}).
#
# How the list is made: pip resolves sglang==0.5.17 for the device's platform against a stub torch 2.11.0 (so torch's
# own CUDA wheels stay out of the resolution), then the distributions the image already has are dropped (EXCLUDE).
# Slimming (bench/peers/slim_sglang.py, with ../shared/gpu/pack.py's helpers, on every wheel): CUDA fatbins keep
# sm_90 cubins only (PTX where a container has no sm_90 cubin), sgl_kernel/sm100 (loaded on non-Hopper GPUs only),
# xgrammar's static library and tvm-ffi's bundled sources are dropped, debug sections stripped; wheels are re-stored
# uncompressed for xz. Nothing an H100/H200 loads is removed; GPU_KEEP_SM=NN keeps another arch.
# The bundle is kept in the cache: a second run only re-chunks it (SGLANG_REBUNDLE=1 slims and compresses again).
# Env: SGLANG_WHEEL_CACHE (.whl/sglang-cache), SGLANG_CARRY_DIR (.carry), SGLANG_CHUNK_MIB (60, or less when the
#      repo's own files leave less room under 64 MiB), SGLANG_XZ_LEVEL (3), PYTHON (python3), SHARED_GPU (../shared/gpu).
set -euo pipefail
ROOT=$(pwd)
CACHE=${SGLANG_WHEEL_CACHE:-$ROOT/.whl/sglang-cache}
CARRY=${SGLANG_CARRY_DIR:-$ROOT/.carry}
# the repo's tracked + untracked-not-ignored files travel with every transfer (64 MiB in all), as in the GPU kit
TREE_KIB=$( (git ls-files -z -c -o --exclude-standard 2>/dev/null | du -c -k --files0-from=- 2>/dev/null | tail -1 | cut -f1) || true)
CHUNK_MIB=${SGLANG_CHUNK_MIB:-$(( (63 * 1024 - ${TREE_KIB:-0} - 64) / 1024 ))}
if [ "$CHUNK_MIB" -gt 60 ]; then CHUNK_MIB=60; fi
if [ "$CHUNK_MIB" -lt 8 ]; then echo "the repo's own files (${TREE_KIB} KiB) leave no room for a chunk" >&2; exit 1; fi
LEVEL=${SGLANG_XZ_LEVEL:-3}
PY=${PYTHON:-python3}
SHARED=${SHARED_GPU:-$ROOT/../shared/gpu}
SGLANG=sglang==0.5.17
# what the device image has (torch 2.11.0+cu130 and everything it pulls in, a CUDA toolkit for JIT builds): never
# shadow them from SGLang's site directory (a second triton or CUDA runtime next to torch's breaks torch)
EXCLUDE="torch triton nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-cccl
nvidia-cuda-nvdisasm sympy mpmath networkx jinja2 markupsafe filelock fsspec typing-extensions setuptools"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none"
for n in 5 12 17 24 25 26 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any"
mkdir -p "$CACHE/dl" "$CACHE/stub"

echo "== resolve $SGLANG for cp312 manylinux x86_64 (torch stubbed)" >&2
STUB="$CACHE/stub/torch-2.11.0+stub-py3-none-any.whl"
if [ ! -f "$STUB" ]; then
  "$PY" - "$STUB" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w") as z:
    info = "torch-2.11.0+stub.dist-info/"
    z.writestr("torch/__init__.py", "")
    z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+stub\n")
    z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(info + "RECORD", "")
PYEOF
fi
if [ ! -f "$CACHE/resolved.txt" ]; then
  # shellcheck disable=SC2086
  PIP_CONSTRAINT=/dev/null "$PY" -m pip install -q --dry-run --ignore-installed --disable-pip-version-check \
    --find-links "$CACHE/stub" --target "$CACHE/t" $PLAT --report "$CACHE/report.json" "$SGLANG" "torch==2.11.0+stub"
  "$PY" - "$CACHE/report.json" > "$CACHE/resolved.txt" <<'PYEOF'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"], item["metadata"]["version"], item["download_info"]["url"])
PYEOF
fi
: > "$CACHE/wanted.txt"; : > "$CACHE/excluded.txt"
while read -r name version url; do
  norm=$(echo "$name" | tr 'A-Z_.' 'a-z--')
  if echo " $(echo $EXCLUDE) " | grep -q " $norm "; then echo "$name==$version" >> "$CACHE/excluded.txt"
  else echo "$name==$version $url" >> "$CACHE/wanted.txt"; fi
done < "$CACHE/resolved.txt"
echo "== download $(wc -l < "$CACHE/wanted.txt") wheels (excluded, the image has them: $(paste -sd' ' "$CACHE/excluded.txt"))" >&2
# shellcheck disable=SC2046,SC2086
"$PY" -m pip download -q --no-deps --disable-pip-version-check $PLAT -d "$CACHE/dl" $(cut -d' ' -f1 "$CACHE/wanted.txt")
RAW=$(du -cm "$CACHE"/dl/*.whl | tail -1 | cut -f1)

BUNDLE="$CACHE/sglang.tar.xz"
if [ ! -f "$BUNDLE" ] || [ "${SGLANG_REBUNDLE:-0}" = 1 ]; then
  echo "== slim (sm_${GPU_KEEP_SM:-90} cubins, no debug sections)" >&2
  STAGE=$(mktemp -d)
  mkdir -p "$STAGE/wheels"
  SHARED_GPU=$SHARED "$PY" "$ROOT/bench/peers/slim_sglang.py" "$STAGE/wheels" "$CACHE"/dl/*.whl
  du -cm "$STAGE"/wheels/*.whl | tail -1 | cut -f1 > "$CACHE/slim_mib"
  echo "== bundle (xz -$LEVEL)" >&2
  tar -C "$STAGE" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - wheels | xz -T0 "-$LEVEL" > "$BUNDLE.tmp"
  mv -f "$BUNDLE.tmp" "$BUNDLE"
  rm -rf "$STAGE"
fi
SLIM=$(cat "$CACHE/slim_mib")
echo "== split into <= $CHUNK_MIB MiB chunks" >&2
rm -rf "$CARRY"/sglang[0-9]*
"$PY" - "$BUNDLE" "$CARRY" "$CHUNK_MIB" "$RAW" "$SLIM" <<'PYEOF'
import hashlib, os, sys
bundle, carry, chunk_mib, raw, slim = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
data_sha = hashlib.sha256(open(bundle, "rb").read()).hexdigest()
size, step = os.path.getsize(bundle), chunk_mib * 1024 * 1024 - 64 * 1024   # room for the MANIFEST
lines, parts = [f"bundle sglang {data_sha} {size} xz raw_mib={raw} slim_mib={slim}"], []
with open(bundle, "rb") as handle:
    index = 0
    while chunk := handle.read(step):
        index += 1
        folder = os.path.join(carry, f"sglang{index}")
        os.makedirs(folder, exist_ok=True)
        name = f"sglang.tar.xz.part{index:02d}"
        open(os.path.join(folder, name), "wb").write(chunk)
        lines.append(f"part sglang {index} {name} {hashlib.sha256(chunk).hexdigest()} {len(chunk)} sglang{index}")
for i in range(1, index + 1):
    open(os.path.join(carry, f"sglang{i}", "MANIFEST"), "w").write("\n".join(lines) + "\n")
print(f"{index} chunk(s), bundle {size / 2**20:.1f} MiB (wheels: {raw} MiB downloaded, {slim} MiB slimmed, stored)")
PYEOF
mkdir -p "$CARRY/sglang-tools" && cp -f "$ROOT/bench/peers/install-sglang.sh" "$CARRY/sglang-tools/"
echo "Send .carry/sglang-tools with each of .carry/sglang1..N, one transfer each, back to back; each command starts" >&2
echo "    eval \"\$(bash .carry/sglang-tools/install-sglang.sh)\"" >&2
