"""DeepSpeed's CPU Adam (the host-side optimizer of ``offload_optimizer``) at the threads a Ray actor gets.

    python bench/cpu_adam.py --params 1e9 --out cpu_adam.json        # GPU machine: 1 thread against all cores
    python bench/cpu_adam.py --params 1e6 --steps 2 --out /tmp/a.json  # CPU smoke run

Ray sets ``OMP_NUM_THREADS`` in an actor that reserves no CPU to 1 (``ray._private.utils.set_omp_num_threads_if_
unset``), and the hybrid's trainer ranks reserve none: their CPU Adam runs on one thread unless
``RolePlan.optimizer_threads`` gives them this machine's cores. This bench shows both halves: (1) what a Ray actor
with ``num_cpus=0`` sees (``OMP_NUM_THREADS``, ``torch.get_num_threads()``) with and without that variable in its
``runtime_env``; (2) the step time of ``DeepSpeedCPUAdam`` over ``--params`` fp32 parameters (one flat tensor with its
gradient: 16 bytes a parameter of host memory), and of the gradient norm and scaling ZeRO does in torch on the host
gradients beside it, in a fresh process per thread count. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEP = r"""
import json, statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
params, steps = int(float(sys.argv[1])), int(sys.argv[2])
weight = torch.nn.Parameter(torch.zeros(params))
weight.grad = torch.full((params,), 1e-3)
started = time.perf_counter()
optimizer = DeepSpeedCPUAdam([weight], lr=1e-6)
build = time.perf_counter() - started
times = []
for _ in range(steps + 1):
    started = time.perf_counter()
    optimizer.step()
    times.append(time.perf_counter() - started)
others = []  # ZeRO's host-side work beside the step: the gradient norm and the clip's scaling, in torch on the CPU
for _ in range(steps):
    started = time.perf_counter()
    torch.linalg.vector_norm(weight.grad)
    weight.grad.mul_(1.0)
    others.append(time.perf_counter() - started)
print(json.dumps({"torch_threads": torch.get_num_threads(), "build_s": build, "step_s": times[1:],
                  "norm_and_scale_s": others}))
"""


def ray_actor_threads() -> dict:
    """``OMP_NUM_THREADS`` and torch's threads in a ``num_cpus=0`` Ray actor, without and with the variable set."""
    import ray

    inherited = os.environ.pop("OMP_NUM_THREADS", None)  # Ray's own default, not one the workers inherit from here
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Probe:
            def threads(self) -> dict:
                import torch

                return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads()}

        cores = str(len(os.sched_getaffinity(0)))
        plain = Probe.remote()
        given = Probe.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": cores}}).remote()
        return {"default": ray.get(plain.threads.remote(), timeout=120),
                "optimizer_threads": ray.get(given.threads.remote(), timeout=120)}
    finally:
        ray.shutdown()
        if inherited is not None:
            os.environ["OMP_NUM_THREADS"] = inherited


def time_steps(params: float, steps: int, threads: int, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", STEP, str(params), str(steps)], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if done.returncode:
        return {"threads": threads, "returncode": done.returncode, "error": done.stderr.strip().splitlines()[-5:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"threads": threads, **result, "median_step_s": statistics.median(result["step_s"]),
            "median_norm_and_scale_s": statistics.median(result["norm_and_scale_s"])}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--params", type=float, default=1e9, help="fp32 parameters stepped (16 bytes each on host)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per thread count (after one untimed)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts (default: 1 and this machine's cores)")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit of each thread count's process (s)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray actor check")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    result: dict = {"date": time.strftime("%Y-%m-%d"), "cores": cores, "params": args.params}
    if not args.no_ray:
        result["ray_actor"] = ray_actor_threads()
    result["runs"] = [time_steps(args.params, args.steps, threads, args.timeout)
                      for threads in args.threads or sorted({1, cores})]
    timed = [run for run in result["runs"] if "median_step_s" in run]
    if len(timed) > 1:
        result["speedup"] = timed[0]["median_step_s"] / timed[-1]["median_step_s"]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}),
          [(run["threads"], run.get("median_step_s"), run.get("median_norm_and_scale_s")) for run in result["runs"]])
    return result


if __name__ == "__main__":
    main()
