"""GAE on packed streams: rlhfkit's blocked-matmul scan vs a per-step padded scan vs a per-token Python loop.

Three ways to compute the same advantages and returns (checked against each other in every run):

- ``loop``: the naive reference, a reverse Python loop over the loss tokens of every sequence (Python floats).
- ``step_scan``: loss tokens gathered into a right-padded ``[N, L]`` matrix, then a reverse loop over the ``L``
  steps with all sequences in parallel (one vector operation per step; the usual implementation).
- ``rlhfkit``: :func:`rlhfkit.advantages.gae` (same gather, then a blocked matmul scan with no loop over time).

Usage (CPU):  python bench/gae.py --out bench-gae-cpu.json
       (GPU):  python bench/gae.py --device cuda --out bench-gae-gpu.json
Prints a table and writes a JSON with the median time of each method per configuration and the speedups.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from rlhfkit.advantages import gae

# (num_seqs, min response length, max response length); prompts are 8..64 tokens.
CONFIGS = [(64, 16, 256), (256, 16, 1024), (512, 64, 4096), (1024, 64, 8192)]


def make_batch(num_seqs: int, min_len: int, max_len: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(8, 65, (num_seqs,), generator=g)
    response = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g)
    lengths = prompt + response
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    mask = torch.zeros(int(cu[-1]), dtype=torch.bool)
    for i in range(num_seqs):
        mask[int(cu[i]) + int(prompt[i]) : int(cu[i + 1])] = True
    rewards = torch.randn(mask.numel(), generator=g) * 0.01
    values = torch.randn(mask.numel(), generator=g)
    return [x.to(device) for x in (rewards, values, mask, cu)]


def gae_loop(rewards, values, mask, cu, gamma, lam):
    r, v, m, c = rewards.tolist(), values.tolist(), mask.tolist(), cu.tolist()
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    for i in range(len(c) - 1):
        last, next_value = 0.0, 0.0
        for t in range(c[i + 1] - 1, c[i] - 1, -1):
            if not m[t]:
                continue
            delta = r[t] + gamma * next_value - v[t]
            last = delta + gamma * lam * last
            adv[t], ret[t] = last, last + v[t]
            next_value = v[t]
    return torch.tensor(adv, device=rewards.device), torch.tensor(ret, device=rewards.device)


def gae_step_scan(rewards, values, mask, cu, gamma, lam):
    positions = torch.nonzero(mask).flatten()
    row = torch.bucketize(positions, cu[1:].long(), right=True)
    counts = torch.bincount(row, minlength=cu.numel() - 1)
    start = torch.cumsum(counts, 0) - counts
    column = torch.arange(positions.numel(), device=mask.device) - start[row]
    shape = (cu.numel() - 1, int(counts.max()))
    r = torch.zeros(shape, device=mask.device).index_put_((row, column), rewards[mask])
    v = torch.zeros(shape, device=mask.device).index_put_((row, column), values[mask])
    adv = torch.zeros_like(r)
    last = torch.zeros(shape[0], device=mask.device)
    for t in reversed(range(shape[1])):
        next_value = v[:, t + 1] if t + 1 < shape[1] else torch.zeros_like(last)
        delta = r[:, t] + gamma * next_value - v[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    adv_out, ret_out = torch.zeros_like(rewards), torch.zeros_like(rewards)
    adv_out[mask] = adv[row, column]
    ret_out[mask] = (adv + v)[row, column]
    return adv_out, ret_out


def timed(fn, args, device, repeats):
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run_config(config, device, repeats, loop_token_limit):
    rewards, values, mask, cu = make_batch(*config, device=device)
    args = (rewards, values, mask, cu, 0.99, 0.95)
    methods = {"rlhfkit": lambda *a: gae(*a[:4], gamma=a[4], lam=a[5]), "step_scan": gae_step_scan}
    if mask.numel() <= loop_token_limit:
        methods["loop"] = gae_loop
    timed(methods["rlhfkit"], args, device, 1)  # warm-up (allocator, kernels)
    timed(methods["step_scan"], args, device, 1)
    result = {"num_seqs": config[0], "response_len": [config[1], config[2]], "tokens": int(mask.numel()),
              "loss_tokens": int(mask.sum())}
    outputs = {}
    for name, fn in methods.items():
        seconds, outputs[name] = timed(fn, args, device, 1 if name == "loop" else repeats)
        result[f"{name}_s"] = seconds
    reference = outputs.get("loop", outputs["step_scan"])
    for name, (adv, ret) in outputs.items():
        error = max(float((adv - reference[0]).abs().max()), float((ret - reference[1]).abs().max()))
        result[f"{name}_max_abs_err"] = error
    result["speedup_vs_step_scan"] = result["step_scan_s"] / result["rlhfkit_s"]
    if "loop_s" in result:
        result["speedup_vs_loop"] = result["loop_s"] / result["rlhfkit_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default="bench-gae.json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-configs", type=int, default=len(CONFIGS), help="run only the first K configurations")
    parser.add_argument("--loop-token-limit", type=int, default=2_000_000, help="skip the Python loop above this")
    args = parser.parse_args()
    results = []
    print(f"{'N':>5} {'resp len':>10} {'tokens':>9} {'loop s':>9} {'step_scan s':>12} {'rlhfkit s':>10} "
          f"{'x step':>7} {'x loop':>7} {'max err':>9}")
    for config in CONFIGS[: args.max_configs]:
        r = run_config(config, args.device, args.repeats, args.loop_token_limit)
        results.append(r)
        loop = f"{r['loop_s']:9.3f}" if "loop_s" in r else f"{'-':>9}"
        x_loop = f"{r['speedup_vs_loop']:7.0f}" if "speedup_vs_loop" in r else f"{'-':>7}"
        print(f"{r['num_seqs']:>5} {str(r['response_len']):>10} {r['tokens']:>9} {loop} {r['step_scan_s']:12.4f} "
              f"{r['rlhfkit_s']:10.4f} {r['speedup_vs_step_scan']:7.1f} {x_loop} {r['rlhfkit_max_abs_err']:9.1e}",
              flush=True)
    meta = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
