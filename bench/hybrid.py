"""Hybrid GRPO side by side with TRL's GRPOTrainer: the default ``examples/grpo_hybrid.py`` and TRL (vLLM colocate,
sleep mode on), the same workload, one after the other in one command on the same card, and their ratios.

    python bench/hybrid.py --model /tmp/smollm2-hf --steps 15 --out hybrid.json            # sleeping (default)
    python bench/hybrid.py --model /tmp/smollm2-hf --steps 15 --resident --out res.json    # both resident
    python bench/hybrid.py --model /tmp/smollm2-hf --steps 100 --no-peer --out grpo100.json
    python bench/hybrid.py --summarize runs/grpo100 --out grpo100.json --plot curve.png  # an existing run dir

Workload: 16 prompts x 8 samples of the built-in arithmetic task, 64 new tokens, fp32 (``--dtype float32``), 2
minibatches, engine memory share 0.15 for TRL (ours: the plan's). Step statistics are medians over the steps after the
first. For each side: step time, the time of each phase, phase switches (sleep/wake + weight sync) as a fraction of the
step, the bytes they copied and their pinned-copy floor (``switch``: medians of the ``switch/*`` keys, e.g.
``over_floor``), device-wide peak GPU memory (NVML; also per process at the device peak, each process named by its
role), time from launch to the first step (wall clock from starting the process to the first step's start, for both
sides), and the reward curve's ends.

A/B runs of a non-default setting edit the plan the example prints (``--plan``, :func:`edit_plan`): e.g.
``--plan "actor.keep_optimizer=false overlap_switches=false engine.memory=0.3"``; the example then runs under
``bench/hybrid.py --run-example EDITS -- <example options>``, which applies them before it starts.

Caches: each side gets its own torch-inductor, Triton and vLLM cache folders under ``--cache`` (default: next to
``--out``), so neither warms the other's compile caches. ``--cold`` empties them first (a fresh machine's start-up);
a second command with the same ``--cache`` measures the warm start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = {"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": 64}


def _literal(text: str):
    """A plan edit's value: true / false / none, a number, or a string."""
    import ast

    lowered = text.lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def edit_plan(plan, edits: str):
    """``plan`` (a :class:`rlhfkit.hybrid.HybridPlan`) with ``edits`` applied: space-separated ``field=value`` (the
    plan's own fields), ``engine.field=value``, ``<role>.field=value`` or ``*.field=value`` (every role)."""
    import dataclasses

    for edit in edits.split():
        target, _, value = edit.partition("=")
        where, _, name = target.rpartition(".")
        value = _literal(value)
        if not where:
            plan = dataclasses.replace(plan, **{name: value})
        elif where == "engine":
            plan = plan.replace_engine(**{name: value})
        else:
            for role in plan.roles if where == "*" else (where,):
                plan = plan.replace_role(role, **{name: value})
    return plan


def example_command(example_args: list[str], plan_edits: str = "") -> list[str]:
    """examples/grpo_hybrid.py with ``example_args``; with ``plan_edits``, run through :func:`run_example`."""
    if not plan_edits:
        return [sys.executable, str(REPO / "examples/grpo_hybrid.py"), *example_args]
    return [sys.executable, str(REPO / "bench/hybrid.py"), "--run-example", plan_edits, "--", *example_args]


def run_example(edits: str, example_args: list[str]) -> None:
    """examples/grpo_hybrid.py's ``main`` with its plan edited by ``edits`` before it starts."""
    import functools
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_hybrid_example", REPO / "examples" / "grpo_hybrid.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    example.main(example_args, edit_plan=functools.partial(edit_plan, edits=edits))


WINDOWS = (1, 10, 20)  # step medians from these steps on: both sides run slower for their first steps


def step_windows(step_times: list[float]) -> dict[str, float]:
    """Median step time from each of ``WINDOWS`` on (``"from_10"``: steps 10, 11, ...), where the run has them."""
    return {f"from_{start}": statistics.median(step_times[start:]) for start in WINDOWS if len(step_times) > start}


def summarize(rows: list[dict], launch_to_first_step_s: float | None = None) -> dict:
    timed = rows[1:] or rows
    keys = sorted({key for row in timed for key in row if key.startswith(("time/", "switch/"))})
    median = {key: statistics.median(row[key] for row in timed if key in row) for key in keys}
    peaks = {key: max(row[key] for row in rows if key in row) for key in {k for r in rows for k in r
                                                                            if k.startswith("mem/")}}
    k = min(10, max(1, len(rows) // 2))
    rewards = [row["reward/mean"] for row in rows]
    gaps = [row["engine_vs_trainer/mean_abs_logprob_diff"] for row in rows
            if "engine_vs_trainer/mean_abs_logprob_diff" in row]
    return {"steps": len(rows), "step_s": median.get("time/step_s"), "median": median,
            "step_s_windows": step_windows([row["time/step_s"] for row in rows if "time/step_s" in row]),
            "step_times": [row["time/step_s"] for row in rows if "time/step_s" in row],
            "phase_switch_fraction": median.get("time/phase_switch_fraction"),
            # bytes the switches copied and their pinned-copy floor (issue 18; floor keys only on a GPU)
            "switch": {key.removeprefix("switch/"): value for key, value in median.items()
                       if key.startswith("switch/")},
            "peak_memory_gib": max(peaks.values()) if peaks else None, "peak_memory_by_phase_gib": peaks,
            "launch_to_first_step_s": launch_to_first_step_s, "first_mean_reward": sum(rewards[:k]) / k,
            "last_mean_reward": sum(rewards[-k:]) / k, "max_abs_kl": max(abs(r.get("kl/mean", 0.0)) for r in rows),
            "max_engine_gap": max(gaps) if gaps else None}


def run_logged(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int, float]:
    """Run ``command`` with its output in ``log``; (exit code, seconds). Past ``timeout`` the run is stopped and the
    code is 124, so the caller still writes its JSON: SIGINT first (the example's ``finally`` closes its Ray
    cluster), then SIGKILL to its whole process group after 20 s, then ``ray stop --force`` — a killed driver's Ray
    workers otherwise keep their pinned host memory (30-50 GiB at 7B) and the next run fails for host memory."""
    import signal

    started = time.time()
    with log.open("w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            stop = _ray_stop_command()
            if stop:
                subprocess.run(stop, stdout=handle, stderr=subprocess.STDOUT, timeout=60, check=False)
    return code, time.time() - started


def _ray_stop_command() -> list[str] | None:
    """``ray stop --force`` through the ``ray`` script, or through its module where only the package is installed
    (a site directory on ``PYTHONPATH``); None without Ray."""
    import importlib.util

    script = shutil.which("ray")
    if script:
        return [script, "stop", "--force"]
    if importlib.util.find_spec("ray") is not None:
        return [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"]
    return None


def read_metrics(out: Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (none when the run wrote none)."""
    metrics = out / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def cache_env(args, side: str) -> dict[str, str]:
    """Per-side compile caches (``--cold`` empties them first)."""
    root = Path(args.cache or args.out.with_suffix(".cache")) / side
    if args.cold and root.exists():
        shutil.rmtree(root)
    dirs = {"TORCHINDUCTOR_CACHE_DIR": root / "inductor", "TRITON_CACHE_DIR": root / "triton",
            "VLLM_CACHE_ROOT": root / "vllm"}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    return os.environ | {k: str(v) for k, v in dirs.items()}


class ProcessMemory:
    """NVML used memory of the first visible GPU (the one both sides run on): the device peak and, at that moment,
    each process's share (a bench-only probe; the phase peaks come from rlhfkit.hybrid's GpuMemorySampler)."""

    def __init__(self, interval_s: float = 0.02) -> None:
        from rlhfkit.hybrid._timer import _load_nvml, _visible_handles

        self.peak, self.at_peak, self.max_by_pid, self._stop = 0, {}, {}, threading.Event()
        self._nvml = _load_nvml()
        if self._nvml is not None:
            try:
                self._nvml.nvmlInit()
                self._handle = _visible_handles(self._nvml)[0]
            except Exception:  # noqa: BLE001 — NVML's own error types: no driver, no GPU, no samples
                self._nvml = None
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)
            self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with contextlib.suppress(Exception):
                used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
                procs = {p.pid: p.usedGpuMemory or 0
                         for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)}
                for pid, value in procs.items():
                    self.max_by_pid[pid] = max(self.max_by_pid.get(pid, 0), value)
                if used > self.peak:
                    self.peak, self.at_peak = used, procs

    def stop(self, names: dict[int, str]) -> dict:
        self._stop.set()
        gib = 1024**3

        def named(by_pid: dict[int, int]) -> dict[str, float]:
            return {f"{names.get(pid, 'other')}:{pid}": round(value / gib, 3) for pid, value in by_pid.items()}

        return {"device_peak_gib": round(self.peak / gib, 3), "by_process_at_peak_gib": named(self.at_peak),
                "max_by_process_gib": named(self.max_by_pid)}


def _pid_roles(phases: Path) -> dict[int, str]:
    names: dict[int, str] = {}
    if phases.exists():
        for line in phases.read_text().splitlines():
            event = json.loads(line)
            if "pid" in event:
                names[int(event["pid"])] = f"{event.get('role')}{event.get('rank', '')}"
    return names


def run_ours(args, out: Path) -> dict:
    example_args = ["--model", args.model, "--out", str(out), "--steps", str(args.steps), "--dtype", "float32",
                    *[f"--{k.replace('_', '-')}={v}" for k, v in WORKLOAD.items()], *args.ours_args.split()]
    edits = " ".join((["*.offload=false engine.sleep_level=0"] if args.resident else []) + [args.plan])
    command = example_command(example_args, edits.strip())
    log = out.with_suffix(".log")
    out.mkdir(parents=True, exist_ok=True)
    env, memory, launched = cache_env(args, "rlhfkit"), ProcessMemory(), time.time()
    code, _ = run_logged(command, log, args.timeout, env)
    processes = memory.stop(_pid_roles(out / "phases.jsonl"))
    rows = read_metrics(out)
    first = rows[0]["timestamp"] - rows[0]["time/step_s"] - launched if rows and "timestamp" in rows[0] else None
    return {"command": " ".join(command), "returncode": code, **(summarize(rows, first) if rows else {}),
            "startup": _startup(log), "process_memory": processes}


def _startup(log: Path) -> dict | None:
    """The example's own "started in X s: {...}" (Hybrid.start: Ray, engines, trainers, models, weight-sync wiring)."""
    import ast

    for line in log.read_text().splitlines():
        if line.startswith("started in "):
            _, _, parts = line.partition(": ")
            return ast.literal_eval(parts) if parts.startswith("{") else {"total_s": float(line.split()[2])}
    return None


def run_trl(args, out: Path) -> dict:
    command = [sys.executable, str(REPO / "bench/peer_trl.py"), "--model", args.model, "--out", str(out),
               "--steps", str(args.steps), "--rollout-batch", str(WORKLOAD["prompts_per_step"]),
               "--samples-per-prompt", str(WORKLOAD["samples_per_prompt"]), "--max-new-tokens",
               str(WORKLOAD["max_new_tokens"]), "--minibatches", "2", "--grad-accum", "1", "--dtype", "float32",
               "--tf32", "--gpu-memory-utilization", "0.15"]
    if args.resident:
        command.append("--no-sleep")
    out.parent.mkdir(parents=True, exist_ok=True)
    env, memory, launched = cache_env(args, "trl"), ProcessMemory(), time.time()
    code, _ = run_logged(command, out.with_suffix(".log"), args.timeout, env)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.setdefault("wall_s", time.time() - launched)
    first = result.get("first_step_unix")
    result["launch_to_first_step_s"] = first - launched if first else None
    result["process_memory"] = memory.stop({})
    result["step_s_windows"] = step_windows([row["time/step_s"] for row in result.get("rows", [])
                                             if "time/step_s" in row])
    return {"command": " ".join(command), "returncode": code, **result}


def ratios(ours: dict, peer: dict) -> dict:
    def ratio(a, b):
        return a / b if a is not None and b else None

    windows, peer_windows = ours.get("step_s_windows") or {}, peer.get("step_s_windows") or {}
    ours_times = ours.get("step_times")
    peer_times = [row["time/step_s"] for row in peer.get("rows", []) if "time/step_s" in row]
    equal = {}
    if ours_times and peer_times and len(ours_times) != len(peer_times):  # the windows over the steps both ran
        steps = min(len(ours_times), len(peer_times))
        windows, peer_windows = step_windows(ours_times[:steps]), step_windows(peer_times[:steps])
        equal = {"equal_steps": steps}
    step_time = ratio(ours.get("step_s"), peer.get("step_s"))
    if equal:  # the median over the steps both ran (step 0 excluded, as in step_s)
        step_time = ratio(windows.get("from_1"), peer_windows.get("from_1"))
    return {"step_time": step_time, **equal,
            "step_time_windows": {name: ratio(value, peer_windows.get(name)) for name, value in windows.items()},
            "peak_memory": ratio(_device_peak_gib(ours), _device_peak_gib(peer)),
            "launch_to_first_step": ratio(ours.get("launch_to_first_step_s"), peer.get("launch_to_first_step_s"))}


def _device_peak_gib(run: dict) -> float | None:
    """The device-wide peak GPU memory (NVML, sampled by this bench for every side alike), else the run's own."""
    sampled = (run.get("process_memory") or {}).get("device_peak_gib")
    if sampled is not None:
        return sampled
    own = run.get("peak_memory_gib")
    return own.get("device") if isinstance(own, dict) else own


def plot_run(rows: list[dict], path: Path, title: str) -> bool:
    """Reward and exact answers, KL and the engine-vs-trainer gap, step time and its phase switches, per step of a
    run's ``metrics.jsonl`` rows (False when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [row["step"] for row in rows]
    figure, (reward, drift, time_) = plt.subplots(1, 3, figsize=(15, 4))
    reward.plot(steps, [row["reward/mean"] for row in rows], label="mean reward")
    reward.plot(steps, [row.get("accuracy", float("nan")) for row in rows], label="exact answers")
    reward.set_xlabel("step")
    reward.legend()
    drift.plot(steps, [row.get("kl/mean", float("nan")) for row in rows], label="KL to the reference (nats/token)")
    drift.plot(steps, [row.get("engine_vs_trainer/mean_abs_logprob_diff", float("nan")) for row in rows],
               label="engine-vs-trainer log-prob gap")
    drift.set_yscale("log")
    drift.set_xlabel("step")
    drift.legend()
    time_.plot(steps, [row["time/step_s"] for row in rows], label="step (s)")
    time_.plot(steps, [row.get("time/phase_switch_s", float("nan")) for row in rows], label="phase switches (s)")
    time_.set_ylim(0, 3 * statistics.median(row["time/step_s"] for row in rows))
    time_.set_xlabel("step")
    time_.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-example"]:  # the example with an edited plan (example_command)
        run_example(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
        return None
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--resident", action="store_true", help="both sides keep everything on the GPU")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--peer-only", action="store_true", help="run TRL only (its half of a side-by-side)")
    parser.add_argument("--timeout", type=float, default=540.0, help="limit of each side's run (s)")
    parser.add_argument("--summarize", type=Path, help="summarise an existing run directory instead")
    parser.add_argument("--plot", type=Path, help="with --summarize: also draw the run's curves into this PNG")
    parser.add_argument("--cache", type=Path, help="compile-cache root (default: next to --out)")
    parser.add_argument("--cold", action="store_true", help="empty the compile caches first (a fresh start)")
    parser.add_argument("--ours-args", default="", help="more options of examples/grpo_hybrid.py, e.g. "
                        "'--lora-rank 16'")
    parser.add_argument("--plan", default="", help="edits of our run's plan (an A/B of a non-default setting), e.g. "
                        "'actor.keep_optimizer=false overlap_switches=false' (see edit_plan)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OURS", "TRL"),
                        help="the ratios of two earlier runs' JSONs (a --no-peer and a --peer-only run)")
    args = parser.parse_args(argv)
    if args.compare:
        ours, peer = (json.loads(path.read_text()) for path in args.compare)
        result = {"ours": str(args.compare[0]), "trl": str(args.compare[1]),
                  "ratio_vs_trl": ratios(ours["rlhfkit"], peer["trl"])}
    elif args.summarize:
        rows = read_metrics(args.summarize)
        result = summarize(rows)
        if args.plot:
            plot_run(rows, args.plot, f"examples/grpo_hybrid.py, {len(rows)} steps ({args.summarize.name})")
    else:
        if not args.model:
            parser.error("--model is required")
        work = args.out.with_suffix("")
        result = {"workload": WORKLOAD, "resident": args.resident, "date": time.strftime("%Y-%m-%d"),
                  "device": _device()}
        if not args.peer_only:
            result["rlhfkit"] = run_ours(args, work / "rlhfkit")
        if not args.no_peer:
            result["trl"] = run_trl(args, work / "trl.json")
            if "rlhfkit" in result:
                result["ratio_vs_trl"] = ratios(result["rlhfkit"], result["trl"])
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "trl"}, indent=2, default=str))
    return result


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return os.uname().machine


if __name__ == "__main__":
    main()
