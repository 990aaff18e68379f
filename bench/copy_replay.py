"""How fast can a recorded copy plan be replayed on one GPU: the copies a planned weight sync makes into a vLLM model,
launched several ways, against one device copy of the same bytes (the floor) measured in the same run.

The workload is what ``bench/ipc_to_vllm.py`` syncs: a 1.54B random Llama (30 layers, hidden 2048, MLP 5632, vocab
384) in bf16. The source is one flat buffer in HF order (as ZeRO-1/2 or ``flatten_parameters`` keeps a trainer's
parameters); the destinations are vLLM-shaped parameters, each its own allocation: ``qkv_proj`` takes q, k and v,
``gate_up_proj`` takes gate and up. 273 source tensors, 183 destination parameters.

    python bench/copy_replay.py --out copy_replay.json

Ways (``--ways``): ``foreach`` (one ``torch._foreach_copy_``, what ``CopyPlan`` replays today), ``loop`` (a
``copy_`` per step), ``coalesced`` (steps that continue each other in both source and destination merged first),
``graph`` (the coalesced copies captured once in a CUDA graph, replayed with one launch: what
``CopyPlan(replay="graph")`` does), ``graph_foreach`` (the foreach copy in a CUDA graph). Per way: median host time
of the launch (the call returning) and median wall time to the end of the copy (``torch.cuda.synchronize``), over
``--repeats`` after 3 warm-ups, and the result checked bitwise against the source.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def layout(layers: int, hidden: int, mlp: int, vocab: int):
    """(HF names and shapes in order, vLLM parameter shapes, and per HF tensor: (vLLM param, row offset))."""
    hf, vllm, where = [], {}, {}
    hf.append(("embed", (vocab, hidden)))
    vllm["embed"] = (vocab, hidden)
    where["embed"] = ("embed", 0)
    for i in range(layers):
        p = f"l{i}."
        for name, rows, dst, off in (("q", hidden, "qkv", 0), ("k", hidden, "qkv", hidden),
                                     ("v", hidden, "qkv", 2 * hidden), ("o", hidden, "o", 0),
                                     ("gate", mlp, "gate_up", 0), ("up", mlp, "gate_up", mlp)):
            hf.append((p + name, (rows, hidden)))
            where[p + name] = (p + dst, off)
        hf.append((p + "down", (hidden, mlp)))
        where[p + "down"] = (p + "down", 0)
        for norm in ("ln1", "ln2"):
            hf.append((p + norm, (hidden,)))
            where[p + norm] = (p + norm, 0)
        vllm |= {p + "qkv": (3 * hidden, hidden), p + "o": (hidden, hidden), p + "gate_up": (2 * mlp, hidden),
                 p + "down": (hidden, mlp), p + "ln1": (hidden,), p + "ln2": (hidden,)}
    hf += [("norm", (hidden,)), ("lm_head", (vocab, hidden))]
    vllm |= {"norm": (hidden,), "lm_head": (vocab, hidden)}
    where |= {"norm": ("norm", 0), "lm_head": ("lm_head", 0)}
    return hf, vllm, where


def build(args, device):
    dtype = torch.bfloat16
    hf, vllm_shapes, where = layout(args.layers, 2048, 5632, 384)
    numel = sum(torch.Size(s).numel() for _, s in hf)
    flat = torch.randn(numel, dtype=dtype, device=device)
    sources, offset = {}, 0
    for name, shape in hf:
        n = torch.Size(shape).numel()
        sources[name] = flat[offset:offset + n].view(shape)
        offset += n
    params = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in vllm_shapes.items()}
    dsts, srcs = [], []
    for name, _ in hf:
        param, row = where[name]
        src = sources[name]
        dsts.append(params[param].narrow(0, row, src.shape[0]) if src.dim() == 2 else params[param])
        srcs.append(src)
    return flat, params, dsts, srcs


def main() -> None:
    from rlhfkit.engines.vllm._copy_plan import coalesce_copies, capture_copies

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ways", nargs="*", default=["foreach", "loop", "coalesced", "graph", "graph_foreach"])
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    flat, params, dsts, srcs = build(args, device)
    nbytes = flat.numel() * flat.element_size()
    pairs = coalesce_copies(dsts, srcs)
    floor_dst = torch.empty_like(flat)

    ways = {
        "floor": lambda: floor_dst.copy_(flat),
        "foreach": lambda: torch._foreach_copy_(dsts, srcs),
        "loop": lambda: [d.copy_(s) for d, s in zip(dsts, srcs)],
        "coalesced": lambda: [d.copy_(s) for d, s in pairs],
    }
    if "graph" in args.ways:
        graph = capture_copies(pairs, [], device)
        ways["graph"] = graph.replay
    if "graph_foreach" in args.ways:
        g2 = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            g2.capture_begin(capture_error_mode="thread_local")
            torch._foreach_copy_(dsts, srcs)
            g2.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        ways["graph_foreach"] = g2.replay

    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "bytes": nbytes,
               "source_tensors": len(srcs), "destination_params": len(params), "coalesced_copies": len(pairs),
               "date": time.strftime("%Y-%m-%d"), "ways": {}}
    for name in ["floor", *args.ways]:
        run = ways[name]
        for p in params.values():
            p.zero_()
        host, wall = [], []
        for i in range(3 + args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            launched = time.perf_counter()
            torch.cuda.synchronize()
            end = time.perf_counter()
            if i >= 3:
                host.append(launched - start)
                wall.append(end - start)
        ok = name == "floor" or all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        med = statistics.median(wall)
        results["ways"][name] = {"host_s": statistics.median(host), "wall_s": med, "min_wall_s": min(wall),
                                 "GBps": nbytes / med / 1e9, "equal": ok}
        print(name, results["ways"][name], flush=True)
    floor = results["ways"]["floor"]["wall_s"]
    for entry in results["ways"].values():
        entry["over_floor"] = entry["wall_s"] / floor
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
