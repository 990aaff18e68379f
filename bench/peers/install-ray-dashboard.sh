#!/usr/bin/env bash
# Run on the GPU machine after the kit's eval line: installs what `ray start --head` (its dashboard) and
# `ray job submit` need beyond the kit's plain `ray` (ray[default]: aiohttp-cors, opencensus, colorful, py-spy, ...)
# from the wheels in .carry/raydash, only those the environment lacks, into /tmp/site/raydash.
#
#     eval "$(bash bench/peers/install-ray-dashboard.sh)"
#
# .carry/raydash is filled on a machine with a package index by:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform any -d .carry/raydash aiohttp-cors colorful opencensus \
#       opencensus-context google-api-core smart_open wrapt py-spy aiohttp aiohappyeyeballs aiosignal frozenlist \
#       multidict yarl propcache prometheus_client opentelemetry-exporter-prometheus grpcio
# stdout carries only `export` lines (APPENDING the folder, so the image's packages win); progress goes to stderr.
set -uo pipefail
CARRY=${RAYDASH_CARRY_DIR:-.carry/raydash}
SITE=${RAYDASH_SITE:-/tmp/site/raydash}
PY=${PYTHON:-python3}
exports() { echo "export PYTHONPATH=\${PYTHONPATH:+\$PYTHONPATH:}$SITE"; echo "export PATH=\$PATH:$SITE/bin"; }
if [ -f "$SITE/.installed" ]; then exports; exit 0; fi
ls "$CARRY"/*.whl >/dev/null 2>&1 || { echo "[raydash] no wheels in $CARRY" >&2; exit 1; }
wanted=$("$PY" - "$CARRY" <<'PYEOF'
import pathlib, sys
from importlib import metadata
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        print(f"[raydash] skip {name} (present: {metadata.version(name)})", file=sys.stderr)
    except metadata.PackageNotFoundError:
        print(f"[raydash] add  {name}", file=sys.stderr)
        print(wheel)
PYEOF
)
mkdir -p "$SITE"
if [ -n "$wanted" ]; then
  # shellcheck disable=SC2086
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$SITE" $wanted >&2 || { echo "[raydash] pip install failed" >&2; exit 1; }
fi
touch "$SITE/.installed"
exports
