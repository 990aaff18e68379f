"""Packed vs padded forward + backward throughput (real tokens per second) on a small random Llama.

Sequence lengths are drawn uniformly from [--min-len, --max-len]. One training step = every micro-batch through
forward, chunked token log-probs (rlhfkit.losses.token_logprobs, the same function on both sides), a token-mean
loss and backward. Layouts:
  padded_random   micro-batches of --micro-seqs sequences in arrival order, right-padded to the micro-batch's longest
                  (what a plain DataLoader + attention_mask gives)
  padded_sorted   the same after sorting by length (a strong padded baseline: little padding left)
  packed@B        sequences packed into micro-batches balanced by rlhfkit.packing.partition_by_token_budget with a
                  budget of B tokens, run with rlhfkit.losses.model_logprobs (one row, restarting position_ids,
                  attention_mask=None: transformers builds a block-diagonal mask, or the boundaries go to
                  flash-attention varlen / rlhfkit_varlen_sdpa, which compute only each sequence's own block)
Throughput counts only real tokens, so padding is pure cost. All layouts get the same loss up to float error; the
script checks it. With dense-mask attention (eager/sdpa) a packed micro-batch pays attention over its whole length
(masked blocks are computed, then discarded), so the token budget trades padding waste for attention waste;
rlhfkit_varlen_sdpa and flash-attention do not have that waste. Several budgets are reported.

    python bench/packing.py --out packing-cpu.json                                     # CPU, < 2 minutes
    python bench/packing.py --device cuda --dtype bfloat16 --num-seqs 256 --micro-seqs 16 \\
        --hidden 1024 --layers 8 --max-tokens 4096 8192 16384 --attn sdpa flex_attention --out packing-gpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _build_model(args, attn):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhfkit.packing import register_varlen_attention

    register_varlen_attention()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=max(args.max_len, 1024))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=getattr(torch, args.dtype))
    return model.to(args.device).train()


def _padded_loss(model, seqs, total_tokens):
    import torch

    from rlhfkit.losses import token_logprobs

    lengths = torch.tensor([len(s) for s in seqs])
    width = int(lengths.max())
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=seqs[0].device)
    attention = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        attention[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    labels = torch.roll(ids, -1, dims=1)
    logprobs = token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).view(ids.shape)
    # row t predicts token t + 1: valid while t + 1 < length
    valid = torch.arange(width, device=ids.device)[None, :] + 1 < lengths.to(ids.device)[:, None]
    return -(logprobs * valid).sum() / total_tokens


def _packed_loss(model, seqs, total_tokens):
    import torch

    from rlhfkit.losses import model_logprobs
    from rlhfkit.packing import pack_sequences

    batch = pack_sequences(seqs, loss_masks=[torch.arange(len(s), device=s.device) > 0 for s in seqs])
    logprobs = model_logprobs(model, batch)
    return -(logprobs * batch.loss_mask).sum() / total_tokens


def _layouts(args, seqs):
    """[(name, attn, kind, micro_batches)]: padded baselines once (with sdpa), packed budgets for every --attn."""
    from rlhfkit.packing import partition_by_token_budget

    order = list(range(len(seqs)))
    chunks = [order[i: i + args.micro_seqs] for i in range(0, len(order), args.micro_seqs)]
    by_length = sorted(order, key=lambda i: len(seqs[i]))
    sorted_chunks = [by_length[i: i + args.micro_seqs] for i in range(0, len(order), args.micro_seqs)]
    layouts = [("padded_random", "sdpa", "padded", chunks), ("padded_sorted", "sdpa", "padded", sorted_chunks)]
    for attn in args.attn:
        for budget in args.max_tokens:
            bins = partition_by_token_budget([len(s) for s in seqs], max_tokens=max(budget, args.max_len))
            layouts.append((f"packed@{budget}", attn, "packed", bins))
    return layouts


def _step(model, kind, micro_batches, seqs, total_tokens):
    loss_fn = _padded_loss if kind == "padded" else _packed_loss
    total = 0.0
    for indices in micro_batches:
        loss = loss_fn(model, [seqs[i] for i in indices], total_tokens)
        loss.backward()
        total += float(loss.detach())
    return total


def _timed_step(args, model, kind, micro_batches, seqs, total_tokens):
    import torch

    model.zero_grad(set_to_none=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = _step(model, kind, micro_batches, seqs, total_tokens)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu, loss


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_seqs)]
    gen = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(0, args.vocab, (n,), generator=gen).to(args.device) for n in lengths]
    real_tokens = sum(lengths)
    total_tokens = float(real_tokens - len(lengths))  # loss tokens: all but each sequence's first
    layouts = _layouts(args, seqs)
    models = {}
    for _, attn, _, _ in layouts:
        if attn not in models:
            models[attn] = _build_model(args, attn)
            models[attn].load_state_dict(next(iter(models.values())).state_dict())
    timings = {i: {"wall": [], "cpu": [], "loss": None} for i in range(len(layouts))}
    # Rounds interleave the layouts so that load from other processes hits all of them alike.
    for round_index in range(args.warmup + args.repeats):
        for i, (_, attn, kind, micro_batches) in enumerate(layouts):
            wall, cpu, loss = _timed_step(args, models[attn], kind, micro_batches, seqs, total_tokens)
            timings[i]["loss"] = loss
            if round_index >= args.warmup:
                timings[i]["wall"].append(wall)
                timings[i]["cpu"].append(cpu)
    results = []
    for i, (name, attn, kind, micro_batches) in enumerate(layouts):
        processed = sum(max(len(seqs[j]) for j in mb) * len(mb) if kind == "padded"
                        else sum(len(seqs[j]) for j in mb) for mb in micro_batches)
        t = timings[i]
        best = min(t["cpu"]) if not args.device.startswith("cuda") else min(t["wall"])
        results.append({"attn": attn, "layout": name, "num_micro_batches": len(micro_batches),
                        "processed_tokens": processed, "real_tokens": real_tokens, "loss": t["loss"],
                        "wall_s": t["wall"], "cpu_s": t["cpu"], "best_s": best,
                        "real_tokens_per_s": real_tokens / best})
    for r in results:
        print(_line(r, results), flush=True)
    return {"config": vars(args), "lengths": lengths, "results": results,
            "timing": "best of repeats; process CPU time on CPU (robust to other load), wall time on CUDA"}


def _line(r, results) -> str:
    base = results[0]
    ratio = r["real_tokens_per_s"] / base["real_tokens_per_s"]
    return (f"{r['attn']:>20} {r['layout']:>14} micro-batches={r['num_micro_batches']:>3} processed="
            f"{r['processed_tokens']:>7} tokens/s={r['real_tokens_per_s']:>9.0f} vs padded_random={ratio:5.2f}x "
            f"loss={r['loss']:.6f}")


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attn", nargs="+", default=["rlhfkit_varlen_sdpa"],
                        help="eager, sdpa, rlhfkit_varlen_sdpa, flex_attention (GPU), flash_attention_2 (if installed)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--micro-seqs", type=int, default=4, help="sequences per padded micro-batch")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[512, 1024, 2048],
                        help="packed token budgets (raised to --max-len if lower)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    report = run(args)
    if args.device.startswith("cuda"):
        import torch

        report["gpu"] = torch.cuda.get_device_name(0)
    losses = [r["loss"] for r in report["results"]]
    spread = (max(losses) - min(losses)) / max(abs(min(losses)), 1e-12)
    report["loss_relative_spread"] = spread
    print(f"loss relative spread across layouts: {spread:.2e} (same loss up to float error)")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
