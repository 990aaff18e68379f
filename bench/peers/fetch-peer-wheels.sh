#!/usr/bin/env bash
# Build .carry/peers: the wheels TRL's GRPOTrainer and OpenRLHF need on the offline GPU machine beyond the GPU kit
# (../shared/gpu: vllm 0.22.1, ray 2.60.0, deepspeed 0.19.8, vllm's deps). Run on a networked machine, repo root:
#
#     bash bench/peers/fetch-peer-wheels.sh
#
# Output: .carry/peers/peers.tar.xz (slimmed cp312 manylinux x86_64 wheels) + .carry/peers/MANIFEST (one line per
# wheel: distribution, version, file, sha256; then the bundle's sha256 and size). Send .carry/peers together with
# .carry/gpu-tools in one transfer; bench/peers/install-peers.sh unpacks it on the device. Fails if the bundle
# exceeds PEERS_MAX_MIB (58: the 64 MiB transfer minus the repo tree and gpu-tools).
#
# Not carried: flash-attn (no wheel; OpenRLHF runs without it on the non-packing path, see bench/peer_openrlhf.sh),
# wandb / tensorboard (imported only when asked for), bitsandbytes, optimum, liger-kernel, ring-flash-attn and
# OpenRLHF's other optional imports; OpenRLHF's own pins (deepspeed 0.19.1, ray 2.55.0, transformers 5.7.0) are
# ignored in favour of the kit's versions (installed with --no-deps).
# Env: PEERS_WHEEL_CACHE (.whl/peers-cache), PEERS_CARRY_DIR (.carry/peers), PEERS_MAX_MIB (58), PYTHON (python3).
set -euo pipefail
ROOT=$(pwd)
CACHE=${PEERS_WHEEL_CACHE:-$ROOT/.whl/peers-cache}
CARRY=${PEERS_CARRY_DIR:-$ROOT/.carry/peers}
MAX_MIB=${PEERS_MAX_MIB:-58}
PY=${PYTHON:-python3}

# Versions, checked against the device (Python 3.12, torch 2.11, transformers 5.17 -> huggingface-hub >= 1.5, < 2)
# and against each other (dill 0.4.1 is carried since session 19: the image stopped shipping it, and datasets reads
# its metadata at import): trl 1.16.0 wants accelerate>=1.10.1, datasets>=4.7.0,
# pandas>=2.1.1, pyarrow>=21, vllm>=0.22.0,<=0.31.0 (extra); datasets 4.8.5 wants huggingface-hub>=0.25,<2,
# dill<0.4.2, multiprocess<0.70.20, fsspec<=2026.2.0 (datasets 5.x would need huggingface-hub>=1.31, which the
# image's transformers 5.17 may not have). pandas 2.3.3 (not 3.x): the series datasets 4.8 was tested against.
TRL_PKGS="trl==1.16.0 accelerate==1.15.0 datasets==4.8.5 pyarrow==23.0.1 pandas==2.3.3 multiprocess==0.70.19 dill==0.4.1
xxhash==3.6.0 fsspec==2026.2.0 python-dateutil==2.9.0.post0 pytz==2025.2 tzdata==2025.2 six==1.17.0"
OPENRLHF_PKGS="openrlhf==0.10.4 peft==0.21.2 torchdata==0.11.0 pylatexenc==2.11"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 5 12 17 24 25 26 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64"

mkdir -p "$CACHE/dl" "$CARRY"
echo "== download into $CACHE/dl" >&2
# shellcheck disable=SC2086
"$PY" -m pip download -q --disable-pip-version-check --no-deps $PLAT -d "$CACHE/dl" $TRL_PKGS $OPENRLHF_PKGS

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/wheels"
echo "== slim (pyarrow: no Flight/S3/headers/tests; pandas: no tests; .so symbols stripped)" >&2
"$PY" - "$STAGE/wheels" "$CACHE/dl" $TRL_PKGS $OPENRLHF_PKGS > "$STAGE/MANIFEST" <<'PYEOF'
import base64, fnmatch, glob, hashlib, os, re, subprocess, sys, tempfile, zipfile

out, dl, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
DROP = {  # globs inside the wheel; none of these is imported by datasets / TRL / OpenRLHF
    "pyarrow": ["pyarrow/include/*", "pyarrow/src/*", "pyarrow/tests/*", "pyarrow/*flight*", "pyarrow/libarrow_s3*",
                "pyarrow/_s3fs*", "pyarrow/_pyarrow_cpp_tests*", "pyarrow/*.pxd", "pyarrow/*.pyx",
                "pyarrow/includes/*"],
    "pandas": ["pandas/tests/*"],
    "openrlhf": ["openrlhf-*.data/purelib/tests/*"],  # a top-level 'tests' package; not part of the library
}
canon = lambda name: re.sub(r"[-_.]+", "_", name).lower()
for spec in specs:
    name, version = spec.split("==")
    found = [w for w in glob.glob(os.path.join(dl, "*.whl"))
             if canon(os.path.basename(w).split("-")[0]) == canon(name) and os.path.basename(w).split("-")[1] == version]
    if len(found) != 1:
        sys.exit(f"expected one wheel of {spec} in {dl}, found {found}")
    src = found[0]
    drops = DROP.get(canon(name), [])
    dst = os.path.join(out, os.path.basename(src))
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in sorted(zin.infolist(), key=lambda i: i.filename):
            if info.filename == record_name or any(fnmatch.fnmatch(info.filename, g) for g in drops):
                continue
            data = zin.read(info.filename)
            if ".so" in os.path.basename(info.filename) and data[:4] == b"\x7fELF":
                with tempfile.NamedTemporaryFile(delete=False) as tmp:
                    tmp.write(data)
                subprocess.run(["strip", "--strip-unneeded", tmp.name], check=True)
                data = open(tmp.name, "rb").read()
                os.unlink(tmp.name)
            entry = zipfile.ZipInfo(info.filename, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = info.external_attr
            zout.writestr(entry, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{info.filename},sha256={digest},{len(data)}")
        rows.append(f"{record_name},,")
        entry = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
        zout.writestr(entry, "\n".join(rows) + "\n")
    print(f"{canon(name)} {version} {os.path.basename(dst)} "
          f"{hashlib.sha256(open(dst, 'rb').read()).hexdigest()}")
PYEOF
echo "== pack (xz -9e)" >&2
"$PY" - "$STAGE/wheels" "$CARRY" "$MAX_MIB" >> "$STAGE/MANIFEST" <<'PYEOF'
import hashlib, io, lzma, os, sys, tarfile

wheels, carry, max_mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
names = sorted(os.listdir(wheels))
buffer = io.BytesIO()
with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
    for name in names:
        info = tar.gettarinfo(os.path.join(wheels, name), arcname=f"wheels/{name}")
        info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
        with open(os.path.join(wheels, name), "rb") as handle:
            tar.addfile(info, handle)
data = lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME)
size_mib = len(data) / 2**20
if size_mib > max_mib:
    sys.exit(f"peers.tar.xz is {size_mib:.1f} MiB > PEERS_MAX_MIB={max_mib}: drop a package or split it")
with open(os.path.join(carry, "peers.tar.xz.tmp"), "wb") as handle:
    handle.write(data)
os.replace(os.path.join(carry, "peers.tar.xz.tmp"), os.path.join(carry, "peers.tar.xz"))
print(f"bundle peers.tar.xz {hashlib.sha256(data).hexdigest()} {len(data)}")
print(f"{size_mib:.1f} MiB", file=sys.stderr)
PYEOF
cp "$STAGE/MANIFEST" "$CARRY/MANIFEST"
REL=${CARRY#"$ROOT"/}
echo "Ready: $REL/peers.tar.xz ($(du -m "$CARRY/peers.tar.xz" | cut -f1) MiB) + $REL/MANIFEST. On the GPU machine, in one"
echo "transfer with .carry/gpu-tools and $REL, after the kit's eval line:"
echo "    eval \"\$(bash bench/peers/install-peers.sh)\""
