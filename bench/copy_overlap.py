"""Does a host-to-device copy on a side stream (another thread) hide behind a compute loop on the main stream?

The trainer worker wakes an actor's optimizer states (Adam moments, fp32 masters: 18.5 GB at a 1.5B model) in a
background thread while the actor's first forward-backward runs (``DeepSpeedEngine.wake_up(defer_optimizer=True)``,
``finish_wake``). This measures the mechanism alone, on one GPU: a loop of bf16 matmuls that also makes the small
synchronous copies a forward-backward makes (a pageable scalar to the device, one read back every ten iterations),
alone, then beside a ``--gib`` pinned copy issued as one ``copy_`` or in pieces of ``--chunk-mb`` (one in flight at a
time: :func:`rlhfkit.deepspeed_engine._sleep.copy_in_chunks`, what the worker uses).

Per case: the loop's time, the copy's time and the wall time of both. Perfect overlap: ``both`` = max(loop, copy) and
the loop as fast as alone; no overlap: ``both`` = loop + copy.

    python bench/copy_overlap.py --out copy_overlap.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=12.0, help="bytes of the copy (the 1.5B Adam moments: 12.3 GB)")
    parser.add_argument("--chunk-mb", type=int, nargs="+", default=[64, 256], help="piece sizes to try")
    parser.add_argument("--iters", type=int, default=60, help="matmuls of the compute loop")
    args = parser.parse_args()
    import torch

    from rlhfkit.deepspeed_engine._sleep import copy_in_chunks

    if not torch.cuda.is_available():
        raise SystemExit("copy_overlap.py needs a CUDA GPU")
    device = torch.device("cuda")
    host = torch.empty(int(args.gib * 1024**3), dtype=torch.uint8).pin_memory()
    target = torch.empty_like(host, device=device)
    matrix = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def loop(small_copies: bool) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        x = matrix
        for i in range(args.iters):
            x = torch.tanh(x @ matrix) * 0.01
            if small_copies:  # a pageable scalar: a synchronous host-to-device copy on the main stream
                x = x + torch.tensor([float(i)], dtype=torch.bfloat16).to(device)
            if i % 10 == 9:
                float(x[0, 0])  # a read back, as a loss value per micro-batch
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def copy(chunk_mb: int | None) -> float:
        started = time.perf_counter()
        with torch.cuda.stream(side):
            if chunk_mb is None:
                target.copy_(host, non_blocking=True)
            else:
                copy_in_chunks(target, host, chunk_mb * 1024**2)
        side.synchronize()
        return time.perf_counter() - started

    def beside(small_copies: bool, chunk_mb: int | None) -> dict[str, float]:
        result: dict[str, float] = {}
        thread = threading.Thread(target=lambda: result.update(copy=copy(chunk_mb)))
        torch.cuda.synchronize()
        started = time.perf_counter()
        thread.start()
        result["loop"] = loop(small_copies)
        thread.join()
        result["both"] = time.perf_counter() - started
        return {key: round(value, 4) for key, value in result.items()}

    loop(True), copy(None)  # warm-up: kernels, the copy engine
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "copy_gib": args.gib, "iters": args.iters,
                              "loop_alone": round(loop(True), 4), "loop_alone_no_small_copies": round(loop(False), 4),
                              "copy_alone": round(copy(None), 4)}
    out["one_copy_beside_loop"] = beside(True, None)
    out["one_copy_beside_loop_no_small_copies"] = beside(False, None)
    for chunk_mb in args.chunk_mb:
        out[f"copy_alone_{chunk_mb}mb_pieces"] = round(copy(chunk_mb), 4)
        out[f"{chunk_mb}mb_pieces_beside_loop"] = beside(True, chunk_mb)
    print(json.dumps(out, indent=1))
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
