#!/usr/bin/env python3
"""Slim SGLang's wheels for the offline Hopper machine (used by bench/peers/fetch-sglang-wheels.sh).

    slim_sglang.py OUTDIR WHEEL...

Rewrites each wheel uncompressed (for xz) with the helpers of ../shared/gpu/pack.py (SHARED_GPU overrides where it
lies), applied to every distribution, not only vllm:
- CUDA fatbins: entries a GPU of arch GPU_KEEP_SM (90) never loads are zeroed (cubins of other archs; PTX where an sm_90
  cubin exists). Headers stay, so offsets are unchanged. sgl_kernel's flash_ops.abi3.so alone carries 1.1 GB of
  sm_80/86/90 cubins.
- debug sections stripped from shared libraries over 1 MiB.
- dropped files: sgl_kernel/sm100/* (sgl_kernel loads sm90/common_ops on compute capability 9.0, sm100/ on any other),
  xgrammar/lib/* (a static library, build time only), tvm_ffi/3rdparty/* (bundled sources).
Prints one line per wheel it changed and a total.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import os
import sys
import zipfile
from pathlib import Path

SHARED = Path(os.environ.get("SHARED_GPU", Path(__file__).resolve().parents[2] / ".." / "shared" / "gpu"))
sys.path.insert(0, str(SHARED))
import pack

KEEP_SM = int(os.environ.get("GPU_KEEP_SM", "90"))
DROP = {"sglang_kernel": ["sgl_kernel/sm100/*"] if KEEP_SM == 90 else [],
        "xgrammar": ["xgrammar/lib/*"], "apache_tvm_ffi": ["tvm_ffi/3rdparty/*"]}


def slim(src: str, outdir: str) -> dict[str, int]:
    drops = DROP.get(pack.dist_name(src), [])
    dst = os.path.join(outdir, os.path.basename(src))
    stats = {"dropped": 0, "zeroed": 0, "stripped": 0}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_STORED) as zout:
        record, rows = None, []
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record = name
                continue
            if any(fnmatch.fnmatch(name, glob) for glob in drops):
                stats["dropped"] += info.file_size
                continue
            data = zin.read(info)
            if data[:4] == b"\x7fELF" and len(data) > (1 << 20):
                if pack.has_debug(data):
                    new = pack.strip_debug(data)
                    stats["stripped"] += len(data) - len(new)
                    data = new
                data, _, zeroed = pack.prune_fatbin(data, KEEP_SM)
                stats["zeroed"] += zeroed
            entry = zipfile.ZipInfo(name, date_time=info.date_time)
            entry.external_attr, entry.compress_type = info.external_attr, zipfile.ZIP_STORED
            zout.writestr(entry, data)
            rows.append(pack._record_row(name, data))
        rows.append([record, "", ""])
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        entry = zipfile.ZipInfo(record, date_time=(1980, 1, 1, 0, 0, 0))
        entry.external_attr = 0o644 << 16
        zout.writestr(entry, text.getvalue())
    os.replace(dst + ".tmp", dst)
    if any(stats.values()):
        print(f"slim {os.path.basename(src)}: dropped {stats['dropped'] >> 20} MiB, fatbin zeroed "
              f"{stats['zeroed'] >> 20} MiB, debug stripped {stats['stripped'] >> 20} MiB", file=sys.stderr)
    return stats


def main() -> None:
    outdir, wheels = sys.argv[1], sys.argv[2:]
    total = {"dropped": 0, "zeroed": 0, "stripped": 0}
    for wheel in wheels:
        for key, value in slim(wheel, outdir).items():
            total[key] += value
    print(f"slim total: dropped {total['dropped'] >> 20} MiB, fatbin zeroed {total['zeroed'] >> 20} MiB, debug "
          f"stripped {total['stripped'] >> 20} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
