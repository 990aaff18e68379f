"""Chunked vs naive token log-probs, forward + backward, at a large vocabulary: peak memory and time.

Variants (each measured in a fresh subprocess so allocator state cannot leak between them):
  naive            log_softmax(logits.float() / temperature).gather(labels)  — the usual one-liner
  chunked          rlhfkit.losses.token_logprobs (float32 chunks in forward and backward; new gradient buffer)
  chunked_inplace  the same with inplace_backward=True (the gradient overwrites the logits; what model_logprobs uses)

Peak memory is what the log-prob forward + backward adds on top of the logits it is given (the logits themselves
and their gradient are part of any variant's cost only through what the variant allocates: the gradient buffer is
counted, the input logits are not). On CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats. On CPU
torch has no allocator statistics, so the process's resident-set high-water mark is used: it is reset
(``/proc/self/clear_refs`` ← 5) right before the measured call and read from ``VmHWM`` after; large tensors are
mmap'ed by glibc and returned to the OS on free, so the high-water mark follows live tensor memory.

    python bench/logprobs.py --out results.json                                  # CPU defaults (T=1024)
    python bench/logprobs.py --device cuda --tokens 8192 16384 --out gpu.json    # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("naive", "chunked", "chunked_inplace")


def _rss_hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _step(variant: str, logits, labels, temperature: float, chunk_size):
    import torch

    from rlhfkit.losses import token_logprobs

    if variant == "naive":
        scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
        logprobs = torch.log_softmax(scaled, dim=-1).gather(1, labels[:, None]).squeeze(1)
    else:
        logprobs = token_logprobs(logits, labels, temperature=temperature, chunk_size=chunk_size,
                                  inplace_backward=variant == "chunked_inplace")
    logprobs.sum().backward()
    return logprobs.detach()


def _make_inputs(args, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    base = torch.randn(args.tokens, args.vocab, generator=gen, device=device, dtype=dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)
    return base, labels


def run_worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    base, labels = _make_inputs(args, device)
    chunk = args.chunk_size
    # memory: one measured call, nothing else alive but the inputs; logits.view_as(logits) is a non-leaf, like a
    # model's output, so inplace_backward is legal
    logits = base.detach().clone().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = _step(args.variant, logits.view_as(logits), labels, args.temperature, chunk)
        torch.cuda.synchronize()
        peak_extra = torch.cuda.max_memory_allocated() - before
        method = "torch.cuda.max_memory_allocated"
    else:
        reset = _reset_hwm()
        before = _rss_bytes()
        out = _step(args.variant, logits.view_as(logits), labels, args.temperature, chunk)
        peak_extra = _rss_hwm_bytes() - before
        method = "VmHWM (reset via clear_refs)" if reset else "VmHWM (NOT reset: upper bound)"
    reference = torch.log_softmax(base.float() / args.temperature, -1).gather(1, labels[:, None]).squeeze(1)
    max_abs_error = float((out.float() - reference).abs().max())
    del reference, out, logits
    times, cpu_times = [], []
    for i in range(args.warmup + args.repeats):
        logits = base.detach().clone().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        _step(args.variant, logits.view_as(logits), labels, args.temperature, chunk)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        del logits
    # On CPU the process's CPU time (user + sys, page faults included) is robust to other load on a shared machine;
    # on CUDA wall time is the measure.
    best = min(cpu_times) if device.type == "cpu" else min(times)
    return {"variant": args.variant, "device": args.device, "dtype": args.dtype, "tokens": args.tokens,
            "vocab": args.vocab, "temperature": args.temperature, "chunk_size": chunk,
            "logits_bytes": base.numel() * base.element_size(), "peak_extra_bytes": int(peak_extra),
            "memory_method": method, "time_s": best, "time_measure": "process CPU time, best of repeats" if
            device.type == "cpu" else "wall time, best of repeats", "wall_s_median": statistics.median(times),
            "wall_s": times, "cpu_s": cpu_times, "max_abs_error_vs_log_softmax": max_abs_error}


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="T values (default: cpu 1024, cuda 8192)")
    parser.add_argument("--vocab", type=int, default=151_936, help="Qwen2.5's vocabulary by default")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: automatic)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _spawn(args, tokens, dtype, variant) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--device", args.device, "--tokens",
               str(tokens), "--vocab", str(args.vocab), "--dtype", dtype, "--variant", variant, "--temperature",
               str(args.temperature), "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--threads",
               str(args.threads)]
    if args.chunk_size is not None:
        command += ["--chunk-size", str(args.chunk_size)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"variant": variant, "dtype": dtype, "tokens": tokens, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(results: list[dict]) -> list[str]:
    lines = [f"{'T':>6} {'dtype':>9} {'variant':>16} {'logits MiB':>10} {'extra MiB':>10} {'mem vs naive':>12} "
             f"{'time s':>8} {'time vs naive':>13} {'max err':>9}"]
    naive = {(r["tokens"], r["dtype"]): r for r in results if r.get("variant") == "naive" and "error" not in r}
    for r in results:
        if "error" in r:
            lines.append(f"{r['tokens']:>6} {r['dtype']:>9} {r['variant']:>16}  FAILED: {r['error'][-300:]}")
            continue
        base = naive.get((r["tokens"], r["dtype"]))
        mem_ratio = f"{base['peak_extra_bytes'] / max(r['peak_extra_bytes'], 1):.1f}x lower" if base else "-"
        time_ratio = f"{r['time_s'] / base['time_s']:.2f}x" if base else "-"
        lines.append(f"{r['tokens']:>6} {r['dtype']:>9} {r['variant']:>16} {r['logits_bytes'] / 2**20:>10.0f} "
                     f"{r['peak_extra_bytes'] / 2**20:>10.0f} {mem_ratio:>12} {r['time_s']:>8.3f} "
                     f"{time_ratio:>13} {r['max_abs_error_vs_log_softmax']:>9.1e}")
    return lines


def main(argv=None) -> None:
    args = _parse(argv)
    if args.worker:
        args.tokens = args.tokens[0]
        print(json.dumps(run_worker(args)))
        return
    tokens_list = args.tokens or ([8192] if args.device.startswith("cuda") else [1024])
    results = []
    for tokens in tokens_list:
        for dtype in args.dtypes:
            for variant in args.variants:
                results.append(_spawn(args, tokens, dtype, variant))
                print("\n".join(_summary(results)[-1:]), flush=True)
    report = {"device": args.device, "vocab": args.vocab, "threads": args.threads, "results": results}
    if args.device.startswith("cuda"):
        import torch

        report["gpu"] = torch.cuda.get_device_name(0)
    print("\n".join(_summary(results)))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
