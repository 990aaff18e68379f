"""Scale on one GPU (issue 20): hybrid GRPO on random-weight models of real architectures, full-parameter and LoRA,
optionally next to TRL's GRPOTrainer, with per-phase time and peak memory.

    python bench/scale.py --tokenizer /tmp/smollm2-hf --archs qwen2.5-1.5b qwen2.5-7b --steps 10 --out scale.json
    python bench/scale.py --tokenizer /tmp/smollm2-hf --archs qwen2.5-1.5b --peer trl --out scale.json
    python bench/scale.py --tokenizer /tmp/smollm2-hf --archs qwen2.5-7b --modes lora --peer trl --peer-modes lora \
        --out lora7b.json                                        # LoRA against TRL + peft
    python bench/scale.py --tiny --out scale-tiny.json          # CPU: a toy Qwen2 shape, 2 steps (CI)

Models: the architectures' configs written out by hand (the GPU machine has no network), random bf16 weights
(normal, std 0.02), the real vocabulary size and the SmolLM2 tokenizer and chat template of ``--tokenizer`` (its
ids fit every vocabulary here). Each model is built in ``--work-dir``, used by every mode, then deleted unless
``--keep``. Each run is examples/grpo_hybrid.py in its own process under ``--timeout`` seconds.

Modes: ``full`` (every weight trains, bf16 with fp32 masters; the example's plan picks the layout for the card:
``bench/plans.py`` prints it for each size) and ``lora`` (rank ``--lora-rank`` adapters on the attention and MLP
projections; the adapters alone are pushed; engine sleep level 1). ``--plan`` edits our runs' plans (an A/B of a
non-default setting, :func:`bench.hybrid.edit_plan`). ``--peer trl`` runs bench/peer_trl.py (full-parameter, bf16,
vLLM colocate with sleep mode; 7B-8B: ZeRO-3 with the optimizer in host memory and no reference) on the same model
and workload; ``--peer-modes lora`` runs it with peft adapters of the same rank and targets (its reference is the
base model with the adapters disabled, as ours). A run that fails keeps its exit code, the
plan's memory estimate error if that is what stopped it, and its log's tail. Writes a JSON with, per architecture
and mode: median step time, median time of each phase, peak memory per phase, the sync time and bytes, startup.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hybrid import _device, example_command, read_metrics, run_logged, summarize  # noqa: E402

# transformers config fields of each architecture (from the models' published config.json files).
ARCHITECTURES: dict[str, dict] = {
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "qwen2.5-3b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
                   "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": False},
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False},
    # CPU / CI: Qwen2's shape at toy size
    "toy": {"model_type": "qwen2", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "tie_word_embeddings": False},
}
MODES = ("full", "lora")
WORKLOAD = {"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": 128}
TINY_WORKLOAD = {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 8}


def build_model(arch: str, out: Path, tokenizer: str | None, *, device: str) -> Path:
    """Random-weight ``arch`` in bf16 (fp32 for the CPU toy) with the tokenizer of ``tokenizer`` (toy: a fresh
    byte-level BPE), saved with ``save_pretrained``."""
    import torch
    import transformers

    from rlhfkit.tiny_models import CHAT_TEMPLATE, default_corpus, train_tokenizer

    fields = dict(ARCHITECTURES[arch])
    if tokenizer:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    else:
        tok = train_tokenizer(default_corpus(), vocab_size=fields["vocab_size"])
        tok.chat_template = tok.chat_template or CHAT_TEMPLATE
    if len(tok) > fields["vocab_size"]:
        raise ValueError(f"the tokenizer of {tokenizer!r} has {len(tok)} ids > vocab_size={fields['vocab_size']} "
                         f"of {arch}")
    config = transformers.AutoConfig.for_model(**fields, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    dtype = torch.float32 if arch == "toy" else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def build_model_apart(arch: str, out: Path, tokenizer: str | None, *, device: str) -> Path:
    """:func:`build_model`, on a GPU in a child process, so that this process, which then launches the runs, holds no
    GPU memory: the hybrid's fit check counts memory other processes hold (a 7B-8B build left 16.2 GiB in this
    process's allocator cache, and the run was refused for it)."""
    if device == "cpu":
        return build_model(arch, out, tokenizer, device=device)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(build_model, arch, out, tokenizer, device=device).result()


def ours_command(model: Path | None, mode: str, out: Path, *, steps: int, tiny: bool, lora_rank: int,
                 plan_edits: str = "") -> list[str]:
    """examples/grpo_hybrid.py as a scale run (also bench/lora_vllm.py's GRPO check): ``mode`` "full" or "lora";
    ``model`` None: the example's own tiny model (CPU); ``plan_edits``: :func:`bench.hybrid.edit_plan`'s."""
    workload = TINY_WORKLOAD if tiny else WORKLOAD
    args = ["--out", str(out), "--steps", str(steps), *[f"--{k.replace('_', '-')}={v}" for k, v in workload.items()]]
    args += ["--model", str(model)] if model is not None else []
    lora = ["--lora-rank", str(lora_rank)] if mode == "lora" else []
    if tiny:
        return example_command(args + ["--device", "cpu", "--lr", "1e-3"] + lora, plan_edits)
    return example_command(args + ["--lr", "1e-5" if lora else "1e-6"] + lora, plan_edits)


# from this width up (7B-8B) TRL's full-parameter runs take ZeRO-3 with the optimizer in host memory and no reference
LARGE_HIDDEN = 3584


def model_arch(model: Path) -> str:
    return model.name


def sync_summary(rows: list[dict]) -> dict:
    """Median weight-sync time (steps after the first) and the bytes of the last push."""
    syncs = [row["time/weight_sync_s"] for row in rows[1:] or rows if "time/weight_sync_s" in row]
    return {"sync_s": statistics.median(syncs) if syncs else None,
            "sync_bytes": rows[-1].get("sync/bytes") if rows else None}


def run_ours(args, model: Path, mode: str, out: Path) -> dict:
    edits = " ".join((["*.offload=false"] if args.engine_only_sleep else []) + [args.plan]).strip()
    command = ours_command(model, mode, out, steps=args.steps, tiny=args.tiny,
                           lora_rank=4 if args.tiny else args.lora_rank, plan_edits=edits)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    code, wall = run_logged(command, log, args.timeout)
    rows = read_metrics(out)
    result = {"command": " ".join(command), "returncode": code, "wall_s": wall, **(summarize(rows) if rows else {}),
              **sync_summary(rows)}
    if code:
        lines = log.read_text(errors="replace").splitlines()
        result["error"] = next((line for line in lines if "MemoryFitError" in line), None)
        result["log_tail"] = lines[-15:]
    return result


def run_trl(args, model: Path, out: Path, mode: str = "full") -> dict:
    """bench/peer_trl.py on ``model``: ``mode`` "full" (at 7B-8B ZeRO-3 with the optimizer in host memory and no
    reference) or "lora" (peft adapters of ``--lora-rank``, the reference = the base)."""
    workload = TINY_WORKLOAD if args.tiny else WORKLOAD
    command = [sys.executable, str(REPO / "bench/peer_trl.py"), "--model", str(model), "--out", str(out),
               "--steps", str(args.steps), "--rollout-batch", str(workload["prompts_per_step"]),
               "--samples-per-prompt", str(workload["samples_per_prompt"]), "--max-new-tokens",
               str(workload["max_new_tokens"]), "--minibatches", "2", "--grad-accum", "1", "--dtype", "bfloat16",
               "--gpu-memory-utilization", str(args.engine_memory)]
    if mode == "lora":
        command += ["--lora-rank", str(args.lora_rank)]
    elif not args.tiny and ARCHITECTURES[model_arch(model)]["hidden_size"] >= LARGE_HIDDEN:
        # ZeRO-3 with the optimizer in host memory, and no reference (beta 0)
        command += ["--deepspeed", "zero3-offload", "--kl-coef", "0"]
    code, wall = run_logged(command, out.with_suffix(".log"), args.timeout)
    result = json.loads(out.read_text()) if out.exists() else {}
    return {"command": " ".join(command), "returncode": code, "wall_s": wall, **result}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", nargs="+", choices=sorted(ARCHITECTURES), default=["qwen2.5-1.5b", "qwen2.5-3b",
                                                                                      "qwen2.5-7b"])
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES),
                        help="rlhfkit runs per size (none: only the peer, e.g. in a later command)")
    parser.add_argument("--tokenizer", help="HF folder whose tokenizer and chat template the models get "
                                            "(SmolLM2 from examples/convert_smollm2.py)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--engine-memory", type=float, default=0.35, help="TRL's vLLM share of the GPU (ours: the "
                        "plan's)")
    parser.add_argument("--peer", choices=("trl",), default=None)
    parser.add_argument("--peer-modes", nargs="+", choices=MODES, default=["full"],
                        help="the peer's runs per size: full parameters, LoRA (peft, --lora-rank) or both")
    parser.add_argument("--timeout", type=float, default=900.0, help="limit of each run (s)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/rlhfkit-scale"))
    parser.add_argument("--keep", action="store_true", help="keep the built models")
    parser.add_argument("--engine-only-sleep", action="store_true",
                        help="our trainers keep their states on the GPU, only the engine sleeps (TRL's sleep mode)")
    parser.add_argument("--plan", default="", help="edits of our runs' plans (bench.hybrid.edit_plan), e.g. "
                        "'actor.keep_optimizer=false' for an A/B")
    parser.add_argument("--tiny", action="store_true", help="CPU: the toy architecture, 2 steps, HF engine")
    args = parser.parse_args(argv)
    if args.tiny:
        args.archs, args.steps = ["toy"], min(args.steps, 2)
    elif not args.tokenizer:
        parser.error("--tokenizer is required (an HF folder with the SmolLM2 tokenizer), except with --tiny")
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": _device(), "steps": args.steps,
                    "workload": TINY_WORKLOAD if args.tiny else WORKLOAD, "runs": {}}
    for arch in args.archs:
        folder = args.work_dir / arch
        started = time.time()
        if not (folder / "config.json").exists():  # kept from an earlier command (--keep)
            build_model_apart(arch, folder, args.tokenizer, device="cpu" if args.tiny else "cuda")
        runs: dict = {"build_s": time.time() - started}
        for mode in args.modes:
            runs[mode] = run_ours(args, folder, mode, args.work_dir / "runs" / f"{arch}-{mode}")
            print(f"{arch} {mode}: exit {runs[mode]['returncode']}, step {runs[mode].get('step_s')} s, peak "
                  f"{runs[mode].get('peak_memory_gib')} GiB", flush=True)
        for mode in args.peer_modes if args.peer == "trl" else ():
            key = "trl" if mode == "full" else f"trl-{mode}"
            runs[key] = run_trl(args, folder, args.work_dir / "runs" / f"{arch}-{key}.json", mode)
            print(f"{arch} {key}: exit {runs[key]['returncode']}, step {runs[key].get('step_s')} s", flush=True)
        result["runs"][arch] = runs
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # after each size: a later crash keeps these
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
