"""Benchmark of DeepSpeedEngine.sleep()/wake_up() on one GPU (world size 1, NCCL): ZeRO-3 actor with DeepSpeed's
AdamW (FusedAdam) and a reference model (no optimizer), on ``--model`` (e.g. SmolLM2-135M) and on a random-weight
bf16 Llama of >= 1.5B parameters (hidden 2048, 28 layers, intermediate 5632, vocab 32000, full multi-head attention).

    TORCH_CUDA_ARCH_LIST=9.0 python bench/deepspeed_sleep.py --model /path/to/SmolLM2-135M --out ds_sleep.json
    python bench/deepspeed_sleep.py --cpu-smoke --out smoke.json   # CPU: plumbing only (builds a tiny Llama)

Every (model, role) section runs in its OWN fresh Python process (this script with ``--section NAME``), started by
the parent with a timeout, so that no section sees memory left by another: the parent never touches CUDA, first builds
the FusedAdam JIT extension in a throw-away process (timed, outside every section), then runs the sections one after
another, merges each section's JSON into ``--out`` (rewritten after each section) and records a failed, crashed or
timed-out section as an error while the others go on. Per-section JSON and logs go to ``<out stem>.sections/``.

Per section it measures
- memory awake (after a training step) vs asleep: torch allocated and reserved, this process's memory in nvidia-smi
  (the row of the section's own PID) and the device's used memory. Ratios asleep ÷ awake are given absolute (judged
  against the 10% goal of issue 5) and net of the process before the engine was built; the process right after CUDA
  init (context only) is recorded as ``process.baseline_cuda_context``;
- bit-identity: checksums of every state tensor (bf16 shards, fp32 masters, Adam moments, grad partitions) before
  sleep() and after wake_up(); the reference model's log-probs before/after;
- training continues as if it never slept: the same engine trains on with a sleep/wake before every step; then a
  second engine built identically trains the same steps without sleeping; the two loss trajectories must be equal;
- time: sleep + wake (first cycle, which pins host buffers, and the median of the cycles) ÷ floor, where floor =
  bytes moved ÷ pinned device→host bandwidth + bytes ÷ host→device bandwidth, measured in this run with a pinned
  copy of the same bytes (capped at ``--floor-cap-gib``);
- ``--cycles`` (< 1B params) / ``--large-cycles`` sleep/wake cycles: torch allocated/reserved after wake and host RSS,
  first vs last cycle (growth <= 1%). ``--budget-s`` is per section, counted from the section process's start: cycle
  loops stop when it is spent (recorded as ``truncated_by_budget``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

GIB = 1024**3


def _setup_env(cpu: bool) -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # outside the ephemeral range: nothing takes it before rank 0 binds it
        from rlhfkit._ports import free_listen_port

        os.environ["MASTER_PORT"] = str(free_listen_port(host="127.0.0.1"))
    if cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
        return
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if not arch or arch.endswith("a"):  # DeepSpeed 0.19.8 cannot parse "9.0a" (the image's default)
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the twin-run comparison


# ---------------------------------------------------------------------------------------------- measurements
def process_gpu_mib() -> dict:
    """This process's GPU memory per nvidia-smi (MiB), and the device's used memory per cudaMemGetInfo."""
    out: dict = {}
    if not torch.cuda.is_available():
        return out
    free, total = torch.cuda.mem_get_info()
    out["device_used_mib"] = (total - free) / 2**20
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        rows = [line.split(",") for line in text.strip().splitlines() if "," in line]
        mine = [float(mem) for pid, mem in rows if int(pid) == os.getpid()]
        if mine:
            out["nvidia_smi_process_mib"] = mine[0]
            out["nvidia_smi_pid"] = "own"
        elif len(rows) == 1:  # a container may show host PIDs; the parent holds no CUDA context, so the one is us
            out["nvidia_smi_process_mib"] = float(rows[0][1])
            out["nvidia_smi_pid"] = f"only process listed: pid {rows[0][0]}, ours {os.getpid()}"
        else:
            out["nvidia_smi_pid"] = f"pid {os.getpid()} not among {len(rows)} processes listed"
    except (OSError, ValueError, subprocess.SubprocessError) as error:
        out["nvidia_smi_error"] = repr(error)
    return out


def memory_snapshot() -> dict:
    snap = {"rss_mib": host_rss_mib()}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        snap.update(allocated_mib=torch.cuda.memory_allocated() / 2**20,
                    reserved_mib=torch.cuda.memory_reserved() / 2**20, **process_gpu_mib())
    return snap


def host_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.int64: torch.int64, torch.int32: torch.int32}


def checksum(tensors: list[torch.Tensor], chunk: int = 1 << 25) -> list[list[int]]:
    """Bitwise checksums (sum and position-weighted sum of the integer views), computed on the tensors' device."""
    sums = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).view(_INT_VIEW[tensor.dtype])
        plain = weighted = 0
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk].to(torch.int64)
            weights = (torch.arange(start, start + part.numel(), device=part.device) % 1009) + 1
            plain += int(part.sum())
            weighted += int((part * weights).sum())
        sums.append([plain, weighted, tensor.numel()])
    return sums


def pinned_bandwidth(nbytes: int, repeats: int = 3) -> dict:
    """Best-of-``repeats`` pinned device->host and host->device copy bandwidth (GB/s) for ``nbytes``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    results = {}
    for name, (dst, src) in {"d2h": (host, device), "h2d": (device, host)}.items():
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[f"{name}_gbps"] = nbytes / min(times) / 1e9
    del host, device
    torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------- models and state
def large_llama(seed: int, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(torch.bfloat16)


def engine_state(engine) -> list[torch.Tensor]:
    """Every per-rank state tensor of a ZeRO-3 engine (unique storages only matter for byte counts)."""
    module_shards = [p.ds_tensor for p in engine.module.parameters()]
    if not engine.has_optimizer:
        return module_shards
    wrapper = engine.ds_engine.optimizer
    states = [v for state in wrapper.optimizer.state.values() for k, v in sorted(state.items())
              if torch.is_tensor(v) and v.numel() > 1 and not k.endswith("_offload_buffer")]
    return module_shards + list(wrapper.fp32_partitioned_groups_flat) + [wrapper.grad_partitions_flat_buffer] + states


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def make_batch(vocab: int, num_seqs: int, seq_len: int, seed: int):
    from rlhfkit.packing import pack_sequences

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (seq_len,), generator=gen) for _ in range(num_seqs)]
    return pack_sequences(seqs, loss_masks=[torch.arange(seq_len) >= seq_len // 4 for _ in seqs])


def train_step(engine, batch) -> float:
    logprobs = engine.forward_logprobs(batch)
    mask = batch.loss_mask.to(logprobs.device)
    engine.backward(-(logprobs * mask).sum() / mask.sum())
    return engine.step()["loss"]


# ---------------------------------------------------------------------------------------------- sections
class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def sleep_cycles(engine, cycles: int, deadline: Deadline, check: Callable[[], None] | None = None) -> dict:
    """``cycles`` sleep/wake cycles; times, and memory after wake at the first and last cycle."""
    sleeps, wakes, first, last = [], [], None, None
    for index in range(cycles):
        if deadline.left() < 0:
            break
        start = time.perf_counter()
        engine.sleep()
        middle = time.perf_counter()
        engine.wake_up()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        end = time.perf_counter()
        sleeps.append(middle - start)
        wakes.append(end - middle)
        if index == 0:
            first = memory_snapshot()
    last = memory_snapshot()
    if check is not None:
        check()
    growth = {k: (last[k] - first[k]) / first[k] for k in ("allocated_mib", "reserved_mib", "rss_mib")
              if first and k in first and first[k] > 0}
    return {"cycles_requested": cycles, "cycles_done": len(sleeps), "truncated_by_budget": len(sleeps) < cycles,
            "sleep_s_median": statistics.median(sleeps) if sleeps else None,
            "wake_s_median": statistics.median(wakes) if wakes else None,
            "sleep_s_max": max(sleeps, default=None), "wake_s_max": max(wakes, default=None),
            "memory_first_cycle": first, "memory_last_cycle": last, "growth_fraction": growth,
            "max_growth_fraction": max(growth.values(), default=None)}


def floor_and_ratio(result: dict, nbytes: int, cap_gib: float) -> None:
    if not torch.cuda.is_available():
        return
    measured = min(nbytes, int(cap_gib * GIB))
    bandwidth = pinned_bandwidth(measured)
    floor = nbytes / (bandwidth["d2h_gbps"] * 1e9) + nbytes / (bandwidth["h2d_gbps"] * 1e9)
    result["floor"] = {"bytes_moved": nbytes, "bytes_measured": measured, **bandwidth, "floor_s": floor}
    first = result["first_sleep_s"] + result["first_wake_s"]
    result["ratio_first_cycle"] = first / floor
    cycles = result.get("cycles", {})
    if cycles.get("sleep_s_median") is not None:
        result["ratio_median_cycle"] = (cycles["sleep_s_median"] + cycles["wake_s_median"]) / floor
        # one-time cost of the first sleep (pinned host allocation; prepare_sleep() moves it to a chosen time)
        result["first_sleep_extra_s"] = result["first_sleep_s"] - cycles["sleep_s_median"]
        result["pinned_alloc_gbps"] = nbytes / 1e9 / max(result["first_sleep_extra_s"], 1e-9)


def _timed_sleep_wake(engine) -> tuple[float, float, dict]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    stats = engine.sleep()
    slept = time.perf_counter()
    asleep = memory_snapshot()
    asleep["resident_state_bytes"] = stats.get("resident_state_bytes")  # engine's own storage check (0 = all moved)
    asleep["own_pin_s"] = stats.get("pin_seconds")  # rlhfkit's pinned allocations (DeepSpeed's are not separable)
    resume = time.perf_counter()
    engine.wake_up()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return slept - start, time.perf_counter() - resume, asleep


def run_actor(build: Callable[[], object], batch, args, deadline: Deadline, result: dict) -> dict:
    """Memory, bit-identity, loss continuity against a never-slept twin, timing vs floor, cycles (fills ``result``,
    so that a failure keeps what was measured before it)."""
    result["memory_before_build"] = memory_snapshot()
    engine = build()
    result["parameters"] = sum(p.ds_numel for p in engine.module.parameters())
    losses = [train_step(engine, batch) for _ in range(args.steps_before)]
    result["memory_awake"] = memory_snapshot()
    state = engine_state(engine)
    nbytes = unique_bytes(state)
    before = checksum(state)
    del state
    with torch.no_grad():
        eval_before = engine.forward_logprobs(batch)
    result["first_sleep_s"], result["first_wake_s"], result["memory_asleep"] = _timed_sleep_wake(engine)
    result["identical_after_wake"] = checksum(engine_state(engine)) == before
    with torch.no_grad():
        result["same_logprobs_after_wake"] = bool(torch.equal(engine.forward_logprobs(batch), eval_before))
    del eval_before
    for _ in range(args.steps_after):
        engine.sleep()
        engine.wake_up()
        losses.append(train_step(engine, batch))
    result["losses_with_sleep"] = losses
    before_cycles = checksum(engine_state(engine))
    result["cycles"] = sleep_cycles(engine, args.cycles_for(result["parameters"]), deadline)
    result["identical_after_cycles"] = checksum(engine_state(engine)) == before_cycles
    result["loss_after_cycles"] = train_step(engine, batch)
    engine.destroy()
    del engine
    _release()
    floor_and_ratio(result, nbytes, args.floor_cap_gib)
    twin = build()
    result["losses_never_slept"] = [train_step(twin, batch) for _ in range(args.steps_before + args.steps_after)]
    twin.destroy()
    del twin
    _release()
    result["same_losses_as_never_slept"] = result["losses_never_slept"] == losses
    result["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(losses, result["losses_never_slept"]))
    _ratios(result)
    return result


def run_reference(build: Callable[[], object], batch, args, deadline: Deadline, result: dict) -> dict:
    """The no-optimizer path (rlhfkit's own offload of the ZeRO-3 shards): same checks, log-probs for continuity."""
    result["memory_before_build"] = memory_snapshot()
    engine = build()
    result["parameters"] = sum(p.ds_numel for p in engine.module.parameters())
    with torch.no_grad():
        logprobs = engine.forward_logprobs(batch)
    result["memory_awake"] = memory_snapshot()
    state = engine_state(engine)
    nbytes = unique_bytes(state)
    before = checksum(state)
    del state
    result["first_sleep_s"], result["first_wake_s"], result["memory_asleep"] = _timed_sleep_wake(engine)
    result["identical_after_wake"] = checksum(engine_state(engine)) == before
    with torch.no_grad():
        result["same_logprobs_after_wake"] = bool(torch.equal(engine.forward_logprobs(batch), logprobs))
    result["cycles"] = sleep_cycles(engine, args.cycles_for(result["parameters"]), deadline)
    result["identical_after_cycles"] = checksum(engine_state(engine)) == before
    with torch.no_grad():
        result["same_logprobs_after_cycles"] = bool(torch.equal(engine.forward_logprobs(batch), logprobs))
    engine.destroy()
    del engine
    _release()
    floor_and_ratio(result, nbytes, args.floor_cap_gib)
    _ratios(result)
    return result


def _release() -> None:
    gc.unfreeze()  # frozen objects are never collected: a destroyed engine's cycles would leak its GPU memory
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


GOAL_KEYS = ("allocated", "reserved", "nvidia_smi_process")  # issue 5: absolute asleep/awake <= GOAL for each
GOAL = 0.10


def _ratios(result: dict) -> None:
    """asleep ÷ awake, absolute (judged against ``GOAL``); ``net_*``: both minus what this section's process held
    before the engine was built (CUDA context, NCCL communicator; FusedAdam's module for actors)."""
    awake, asleep, start = result["memory_awake"], result["memory_asleep"], result.get("memory_before_build", {})
    for key in ("allocated_mib", "reserved_mib", "nvidia_smi_process_mib", "device_used_mib"):
        name = key.removesuffix("_mib")
        if key in awake and key in asleep and awake[key] > 0:
            result[f"asleep_over_awake_{name}"] = asleep[key] / awake[key]
        if key in start and key in awake and awake[key] - start[key] > 0:
            result[f"net_asleep_over_awake_{name}"] = (asleep[key] - start[key]) / (awake[key] - start[key])
    absolute = {key: result.get(f"asleep_over_awake_{key}") for key in GOAL_KEYS}
    result["goal"] = {"judged_on": f"absolute asleep/awake <= {GOAL} (issue 5)", "ratios": absolute,
                      "met": None if None in absolute.values() else all(v <= GOAL for v in absolute.values())}


# ---------------------------------------------------------------------------------------------- arguments, sections
PREBUILD = "fused-adam-build"  # the throw-away process that JIT-builds FusedAdam before any section


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF folder of a causal LM (e.g. SmolLM2-135M); omitted: skip (--cpu-smoke: "
                                        "a tiny random Llama is built)")
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--cycles", type=int, default=None,
                        help="sleep/wake cycles for models < 1B parameters (default 200; 3 with --cpu-smoke)")
    parser.add_argument("--large-cycles", type=int, default=200, help="sleep/wake cycles for the >= 1B models")
    parser.add_argument("--skip-large", action="store_true", help="skip the 1.5B random-weight Llama")
    parser.add_argument("--skip-reference", action="store_true", help="skip the no-optimizer reference runs")
    parser.add_argument("--steps-before", type=int, default=2)
    parser.add_argument("--steps-after", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--floor-cap-gib", type=float, default=8.0, help="largest pinned copy for the floor")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="per section: its cycle loops stop once the section's process has run this long")
    parser.add_argument("--section-timeout-s", type=float, default=None,
                        help="kill a section's process after this long (default: --budget-s + 300)")
    parser.add_argument("--no-gc-freeze", action="store_true", help="do not gc.freeze() after building engines")
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU plumbing run (torch AdamW, fp32, gloo)")
    parser.add_argument("--section", help="internal: run only this section in this process; --out gets its JSON")
    args = parser.parse_args(argv)
    if args.cycles is None:
        args.cycles = 3 if args.cpu_smoke else 200
    if args.section_timeout_s is None:
        args.section_timeout_s = args.budget_s + 300.0
    for name in ("cycles", "large_cycles", "steps_before", "seq_len", "num_seqs"):
        if getattr(args, name) < (0 if name == "steps_before" else 1):
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    args.cycles_for = lambda params: args.cycles if params < 1e9 else args.large_cycles
    return args


def _sections(args) -> list[tuple[str, str, str]]:
    """(name, role, source) per section; source is an HF folder or "large" (the random 1.5B Llama). No imports."""
    sources = [(Path(args.model).name, args.model)] if args.model else []
    if not args.skip_large and not args.cpu_smoke:
        sources.append(("llama-1.5b-random", "large"))
    return [(f"{label}/{role}", role, source) for label, source in sources for role in ("reference", "actor")
            if not (args.skip_reference and role == "reference")]


def _builder(source: str, role: str, args) -> Callable[[], object]:
    from rlhfkit.deepspeed_engine import DeepSpeedEngine, DeepSpeedEngineConfig

    config = DeepSpeedEngineConfig(
        zero_stage=3, bf16=not args.cpu_smoke, optimizer="torch_adamw" if args.cpu_smoke else "fused_adam",
        learning_rate=1e-5, gradient_clipping=1.0, attn_implementation="eager")

    def build():
        if source == "large":
            engine = DeepSpeedEngine(large_llama(0, "cuda"), role=role, config=config)
        else:
            engine = DeepSpeedEngine.from_pretrained(source, role=role, config=config)
        if not args.no_gc_freeze:
            gc.collect()
            gc.freeze()  # DeepSpeed's offload_states calls gc.collect(); a frozen heap makes that cheap
        return engine

    return build


# ---------------------------------------------------------------------------------------------- one section (child)
def _init(args, role: str) -> dict:
    """Process group; baselines: right after CUDA init (context only), then with NCCL (+ FusedAdam for actors)."""
    import deepspeed
    import torch.distributed as dist

    if args.cpu_smoke:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        dist.init_process_group("gloo")
        return {"baseline_cuda_context": memory_snapshot()}
    torch.cuda.set_device(0)
    torch.cuda.init()
    info = {"device": torch.cuda.get_device_name(), "baseline_cuda_context": memory_snapshot()}
    torch.use_deterministic_algorithms(True, warn_only=True)  # the twin-run loss comparison needs bitwise repeats
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    dist.all_reduce(torch.ones(1, device="cuda"))  # create the NCCL communicator now, before memory_before_build
    if role == "actor":  # load (the parent built it: JIT cache) before anything is timed
        start = time.perf_counter()
        from deepspeed.ops.op_builder import FusedAdamBuilder

        FusedAdamBuilder().load()
        info["fused_adam_load_s"] = time.perf_counter() - start
    _release()
    return info


def run_section(args) -> int:
    """Child process: run one section, write ``{"pid", "init", "result"[, "error"]}`` to ``--out``."""
    deadline = Deadline(args.budget_s)
    part: dict = {"section": args.section, "pid": os.getpid()}
    out = Path(args.out)
    try:
        if args.section == PREBUILD:
            start = time.perf_counter()
            from deepspeed.ops.op_builder import FusedAdamBuilder

            FusedAdamBuilder().load()
            part["fused_adam_build_s"] = time.perf_counter() - start
        else:
            matches = [s for s in _sections(args) if s[0] == args.section]
            if not matches:
                raise ValueError(f"--section={args.section!r} is not one of {[s[0] for s in _sections(args)]}")
            name, role, source = matches[0]
            part["init"] = _init(args, role)
            vocab = 32000 if source == "large" else json.loads((Path(source) / "config.json").read_text())[
                "vocab_size"]
            large = source == "large"
            batch = make_batch(vocab, 4 if large else args.num_seqs, max(args.seq_len, 512) if large else args.seq_len,
                               seed=1)
            runner = run_actor if role == "actor" else run_reference
            part["result"] = {}
            runner(_builder(source, role, args), batch, args, deadline, part["result"])
            print(summary_line(name, part["result"]), flush=True)
    except Exception:  # noqa: BLE001 — recorded in the JSON; the parent goes on with the next section
        part["error"] = traceback.format_exc()
        print(part["error"], file=sys.stderr, flush=True)
    out.write_text(json.dumps(part, indent=1, default=str))
    return 1 if "error" in part else 0


# ---------------------------------------------------------------------------------------------- parent
def _spawn(section: str, argv: list[str], parts: Path, timeout: float) -> tuple[dict, dict]:
    """Run this script with ``--section`` in a new process (own session, killed as a group on timeout); returns the
    child's JSON part (or ``{}``) and how the process ended."""
    stem = section.replace("/", "__")
    part_path, log_path = parts / f"{stem}.json", parts / f"{stem}.log"
    part_path.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--section", section, "--out", str(part_path)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode: int | str = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, 9)  # the section's process group only (it may have started JIT compilers)
            child.wait()
            returncode = f"killed after the {timeout:.0f} s section timeout"
    process = {"pid": child.pid, "returncode": returncode, "wall_s": time.perf_counter() - start,
               "log": str(log_path)}
    part = json.loads(part_path.read_text()) if part_path.exists() else {}
    if returncode != 0 and "error" not in part:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        part["error"] = "\n".join(["last log lines:", *tail, f"section process ended with {returncode}"])
    return part, process


def _environment(args) -> dict:
    """Versions without importing deepspeed or touching CUDA (the parent must hold no CUDA context)."""
    from importlib.metadata import PackageNotFoundError, version

    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": sys.version.split()[0], "layout": "one process per section",
            "args": {k: v for k, v in vars(args).items() if k != "cycles_for"}}
    for package in ("deepspeed", "transformers"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    return info


def run_parent(args, argv: list[str]) -> int:
    out = Path(args.out)
    parts = out.with_name(out.stem + ".sections")
    parts.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": _environment(args), "init": {}}

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    save()
    with tempfile.TemporaryDirectory(prefix="ds_sleep_tiny_") as tiny:
        if args.cpu_smoke and not args.model:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
            from rlhfkit.tiny_models import build_tiny_model

            args.model = str(build_tiny_model(Path(tiny) / "tiny-llama"))
            argv = [*argv, "--model", args.model]
        sections = _sections(args)
        if not args.cpu_smoke and any(role == "actor" for _, role, _ in sections):
            part, process = _spawn(PREBUILD, argv, parts, args.section_timeout_s + 600)
            results["init"]["fused_adam_build"] = {**part, "process": process}
            save()
            print(f"FusedAdam JIT build: {part.get('fused_adam_build_s', part.get('error'))}", flush=True)
        for name, _, _ in sections:
            part, process = _spawn(name, argv, parts, args.section_timeout_s)
            entry = part.get("result", {})
            if "error" in part:
                entry["error"] = part["error"]
            entry["process"] = {**process, **part.get("init", {})}
            entry["section_s"] = process["wall_s"]
            results[name] = entry
            results["environment"].setdefault("device", part.get("init", {}).get("device"))
            save()
            print(summary_line(name, entry), flush=True)
    goal = {name: results[name].get("goal", {}).get("met") for name, _, _ in sections}
    results["goal_absolute"] = {"judged_on": f"absolute asleep/awake <= {GOAL} for allocated, reserved and "
                                             "nvidia-smi of the section's own PID (issue 5)", "met": goal}
    save()
    print(f"goal (issue 5, ABSOLUTE asleep/awake <= {GOAL} for {', '.join(GOAL_KEYS)}): {goal}")
    print(f"wrote {out} (per-section JSON and logs in {parts})")
    return 1 if any("error" in results[name] for name, _, _ in sections) else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.section is None:
        return run_parent(args, argv)
    _setup_env(args.cpu_smoke)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    return run_section(args)


def summary_line(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name}: ERROR {r['error'].strip().splitlines()[-1]}"
    parts = [f"{name}: {r['parameters'] / 1e6:.0f}M params"]
    for key in ("allocated", "reserved", "nvidia_smi_process"):
        if f"asleep_over_awake_{key}" in r:
            net = r.get(f"net_asleep_over_awake_{key}")
            parts.append(f"{key} asleep/awake abs {r[f'asleep_over_awake_{key}']:.3f}"
                         + (f" (net {net:.3f})" if net is not None else ""))
    if r.get("goal", {}).get("met") is not None:
        parts.append(f"goal abs <= {GOAL}: {'met' if r['goal']['met'] else 'NOT met'}")
    parts.append(f"identical {r.get('identical_after_wake')}/{r.get('identical_after_cycles')}")
    if "same_losses_as_never_slept" in r:
        parts.append(f"same losses {r['same_losses_as_never_slept']}")
    if "same_logprobs_after_wake" in r:
        parts.append(f"same logprobs {r['same_logprobs_after_wake']}")
    if "ratio_median_cycle" in r:
        parts.append(f"first sleep {r['first_sleep_s']:.2f} s (one-time pinning ≈ {r['first_sleep_extra_s']:.2f} s)")
        parts.append(f"(sleep+wake)/floor first {r['ratio_first_cycle']:.2f} median {r['ratio_median_cycle']:.2f} "
                     f"(floor {r['floor']['floor_s']:.3f} s, {r['floor']['bytes_moved'] / GIB:.2f} GiB)")
    cycles = r.get("cycles", {})
    parts.append(f"cycles {cycles.get('cycles_done')}/{cycles.get('cycles_requested')} "
                 f"max growth {cycles.get('max_growth_fraction')}")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
