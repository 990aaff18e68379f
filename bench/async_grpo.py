"""Asynchronous vs synchronous GRPO: ``examples/grpo_async.py --mode async`` and ``--mode sync`` (the same script,
the same layout: the engine resident beside the actor on one GPU, or on a GPU of its own with ``--engine-gpus``),
one after the other, and their ratio (issue 21).

    python bench/async_grpo.py --model /tmp/smollm2-hf --steps 30 --out async.json            # staleness 1, TIS
    python bench/async_grpo.py --model /tmp/smollm2-hf --steps 30 --max-staleness 2 --out async2.json
    python bench/async_grpo.py --model /tmp/smollm2-hf --num-gpus 2 --engine-gpus 1 --out async_2gpu.json
    python bench/async_grpo.py --model /tmp/smollm2-hf --num-gpus 2 --engine-gpus 1 --no-reference --out noref.json
    python bench/async_grpo.py --model /tmp/smollm2-hf --num-gpus 2 --engine-gpus 1 --no-reference \
        --prompts-per-step 8 --out balanced.json          # generation about as long as training
    python bench/async_grpo.py --tiny --out /tmp/async.json                                  # CPU smoke run
    python bench/async_grpo.py --model /tmp/smollm2-hf --num-gpus 2 --engine-gpus 1 --profile-driver --out p.json

Workload: the example's defaults (16 prompts x 8 samples of the arithmetic task, 64 new tokens). For each mode:
samples/s over the run and over the steps after the first, the reward after each step against the samples
trained on so far (the curve the issue compares at equal samples), the staleness histogram (rollouts and tokens)
and the mismatch KL per step. ``speedup_ceiling`` is what overlapping can give at most, from the sync run of the same
command: its step over its step less its wait for rollouts (generation hidden entirely behind training; a bound for
the separated layout, where generation and training do not share a GPU). Writes the JSON to ``--out`` and the
reward curves and staleness to ``--out`` with ``.png`` (when matplotlib is installed). ``--tiny`` runs the
example's CPU smoke run (HF engine, logical GPUs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hybrid import read_metrics, run_logged  # noqa: E402


def summarize(rows: list[dict]) -> dict:
    """Throughput, curves and staleness of one run's ``metrics.jsonl`` rows."""
    later = rows[1:] or rows
    step_s = [row["time/step_s"] for row in later]
    per_step = [row["samples"] - (rows[i - 1]["samples"] if i else 0) for i, row in enumerate(rows)][1:] or \
        [rows[0]["samples"]]
    hist: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("staleness/hist_"):
                hist[key.removeprefix("staleness/hist_")] = hist.get(key.removeprefix("staleness/hist_"), 0) + value
    k = min(5, max(1, len(rows) // 2))
    return {
        "steps": len(rows),
        "samples_per_s": rows[-1]["samples_per_s"],
        "samples_per_s_after_first": sum(per_step) / sum(step_s) if sum(step_s) else None,
        "step_s_median": statistics.median(step_s),
        "wait_rollouts_s_median": statistics.median(row.get("time/wait_rollouts_s", 0.0) for row in later),
        "curve": {"samples": [row["samples"] for row in rows], "reward": [row["reward/mean"] for row in rows],
                  "accuracy": [row["accuracy"] for row in rows]},
        "first_mean_reward": sum(row["reward/mean"] for row in rows[:k]) / k,
        "last_mean_reward": sum(row["reward/mean"] for row in rows[-k:]) / k,
        "staleness_hist": hist,
        "staleness_per_step": [row["staleness/mean"] for row in rows],
        "token_staleness_per_step": [row["staleness/token_mean"] for row in rows],
        "spanning_per_step": [row.get("staleness/spanning", 0.0) for row in rows],  # updated mid-generation
        "mismatch_kl_per_step": [row["mismatch/kl"] for row in rows],
        "dropped_groups": rows[-1].get("buffer/dropped_groups", 0.0),
        # the medians of each phase (time/*): where an async step's extra time goes
        "phases_median": {key: statistics.median(row[key] for row in later if key in row)
                          for key in sorted({k for row in later for k in row
                                             if k.startswith("time/") and k.endswith("_s")})},
    }


def overlap_ceiling(sync: dict) -> float | None:
    """The most an asynchronous loop can gain over ``sync`` (a :func:`summarize` result): ``step / (step - wait)``,
    generation (the wait for rollouts) hidden entirely behind the rest of the step."""
    step, wait = sync.get("step_s_median"), sync.get("wait_rollouts_s_median")
    return step / (step - wait) if step and wait is not None and step > wait else None


def driver_summary(path: Path, steps: int, *, top: int = 15) -> dict[str, float]:
    """The driver's main thread from a ``bench/driver_profile.py`` profile: seconds per step on the stack of each of
    its ``top`` most frequent functions and of every function of the example itself, however rare (wall time there,
    running or waiting). A short run's shutdown can outweigh its steps, so rank alone would drop the step's own
    functions."""
    profile = json.loads(path.read_text())
    main = profile["threads"].get("MainThread", {"inclusive": []})["inclusive"]
    main = [(function, count) for function, count in main  # not the frames that run the script
            if not function.startswith(("driver_profile.py:", "<frozen runpy>:"))]
    kept = main[:top] + [(function, count) for function, count in main[top:] if function.startswith("grpo_async.py:")]
    return {function: count * profile["interval_s"] / max(1, steps) for function, count in kept}


def run_mode(args, mode: str, out: Path) -> dict:
    profile = ([str(REPO / "bench/driver_profile.py"), "--json", str(out / "driver_profile.json")]
               if args.profile_driver else [])
    command = [sys.executable, *profile, str(REPO / "examples/grpo_async.py"), "--out", str(out), "--mode", mode,
               "--max-staleness", str(args.max_staleness), "--correction", args.correction]
    command += ["--device", "cpu", "--tiny", "true"] if args.tiny else ["--model", args.model, "--steps",
                                                                        str(args.steps)]
    command += ["--num-gpus", str(args.num_gpus), "--engine-gpus", str(args.engine_gpus)]
    command += ["--max-new-tokens", str(args.max_new_tokens)] if args.max_new_tokens else []
    command += ["--prompts-per-step", str(args.prompts_per_step)] if args.prompts_per_step else []
    command += ["--samples-per-prompt", str(args.samples_per_prompt)] if args.samples_per_prompt else []
    command += ["--ignore-eos", "true"] if args.ignore_eos else []
    command += ["--pause-engines", "false"] if args.no_pause else []
    command += ["--reference", "false", "--kl-coef", "0"] if args.no_reference else []
    out.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    code, wall = run_logged(command, log, args.timeout)
    rows = read_metrics(out)
    result = {"command": " ".join(command), "returncode": code, "wall_s": wall}
    if code != 0:
        result["log_tail"] = log.read_text()[-2000:]
    if args.profile_driver and (out / "driver_profile.json").exists():
        result["driver_profile_s_per_step"] = driver_summary(out / "driver_profile.json", len(rows))
    return result | (summarize(rows) if rows else {})


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("sync", "async"):
        curve = result[mode].get("curve")
        if curve:
            label = f"{mode} ({result[mode]['samples_per_s_after_first']:.1f} samples/s)"
            left.plot(curve["samples"], curve["reward"], marker=".", label=label)
    left.set_xlabel("samples trained on")
    left.set_ylabel("mean reward")
    left.legend()
    left.set_title("reward at equal samples")
    staleness = result["async"].get("token_staleness_per_step", [])
    right.plot(range(len(staleness)), staleness, label="token staleness (versions)")
    right.plot(range(len(staleness)), result["async"].get("mismatch_kl_per_step", []), label="mismatch KL")
    right.set_xlabel("step")
    right.legend()
    right.set_title(f"async, max_staleness={result['max_staleness']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (GPU runs)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--correction", default="tis", choices=("none", "tis", "token_mask", "seq_mask"))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the example (3 tiny steps)")
    parser.add_argument("--timeout", type=float, default=1500.0, help="limit of each mode's run (s)")
    parser.add_argument("--num-gpus", type=int, default=1)
    parser.add_argument("--engine-gpus", type=int, default=0, help="> 0: the engines on GPUs of their own")
    parser.add_argument("--max-new-tokens", type=int, help="the example's --max-new-tokens (default: its own, 64)")
    parser.add_argument("--prompts-per-step", type=int, help="the example's --prompts-per-step (default: its own, "
                        "16); fewer prompts shorten training more than generation, whose decode steps stay")
    parser.add_argument("--samples-per-prompt", type=int, help="the example's --samples-per-prompt (default: its own, "
                        "8); fewer samples shorten training more than generation, whose decode steps stay")
    parser.add_argument("--no-reference", action="store_true", help="no reference model and no KL term (the "
                        "example's --reference false --kl-coef 0): the trainer's side of the step is shorter")
    parser.add_argument("--ignore-eos", action="store_true", help="every sample runs to --max-new-tokens: generation "
                        "grows with it, so the overlap has more to hide (the example's --ignore-eos true)")
    parser.add_argument("--no-pause", action="store_true", help="the example's --pause-engines false: a push waits "
                        "for the engines' calls in flight instead of parking them mid-generation")
    parser.add_argument("--profile-driver", action="store_true", help="run each mode under bench/driver_profile.py "
                        "(a stack sampler of the driver's threads; slows the steps) and report where its main "
                        "thread spends each step")
    args = parser.parse_args(argv)
    if not args.tiny and not args.model:
        parser.error("--model is required (or --tiny)")
    work = args.out.with_suffix("")
    result = {"date": time.strftime("%Y-%m-%d"), "max_staleness": args.max_staleness, "correction": args.correction,
              "tiny": args.tiny, "sync": run_mode(args, "sync", work / "sync"),
              "async": run_mode(args, "async", work / "async")}
    sync, fast = result["sync"].get("samples_per_s_after_first"), result["async"].get("samples_per_s_after_first")
    result["speedup"] = fast / sync if sync and fast else None
    result["speedup_ceiling"] = overlap_ceiling(result["sync"])
    result["plot"] = str(args.out.with_suffix(".png")) if plot(result, args.out.with_suffix(".png")) else None
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("sync", "async")}, indent=2))
    if result["sync"]["returncode"] or result["async"]["returncode"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
