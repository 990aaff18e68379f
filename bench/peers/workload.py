"""The command-line workload shared by the peer harnesses (bench/peer_trl.py, bench/peer_openrlhf.py): the options of
examples/grpo_hybrid.py that define one step, with the same names and defaults, so one command line drives all."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_workload_arguments(parser: argparse.ArgumentParser, *, dtype_default: str, dtype_help: str) -> None:
    a = parser.add_argument
    a("--model", required=True, help="local HF model folder")
    a("--out", type=Path, required=True, help="JSON to write")
    a("--steps", type=int, default=10, help="generations (each followed by --minibatches optimizer steps)")
    a("--warmup", type=int, default=1, help="steps left out of the medians")
    a("--rollout-batch", type=int, default=32, help="prompts per step")
    a("--samples-per-prompt", type=int, default=8)
    a("--max-new-tokens", type=int, default=96)
    a("--temperature", type=float, default=1.0)
    a("--max-value", type=int, default=99, help="arithmetic operands lie in [0, max-value]")
    a("--lr", type=float, default=5e-6)
    a("--kl-coef", type=float, default=0.001)
    a("--clip", type=float, default=0.2)
    a("--minibatches", type=int, default=2, help="optimizer steps per generation")
    a("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    a("--dtype", choices=("float32", "bfloat16"), default=dtype_default, help=dtype_help)
    a("--tf32", action="store_true", help="float32 training matmuls on TF32 tensor cores")
    a("--gpu-memory-utilization", type=float, default=0.3)
    a("--max-model-len", type=int, default=1024)
    a("--seed", type=int, default=0)


def check_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a workload that does not split into minibatches x micro-batches, naming the numbers."""
    samples = args.rollout_batch * args.samples_per_prompt
    if samples % (args.minibatches * args.grad_accum):
        parser.error(f"{args.rollout_batch} x {args.samples_per_prompt} samples do not split into "
                     f"{args.minibatches} minibatches x {args.grad_accum} micro-batches")
    if args.samples_per_prompt < 2:
        parser.error("GRPO needs --samples-per-prompt >= 2")
