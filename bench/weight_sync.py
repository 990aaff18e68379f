"""Benchmark of rlhfkit.weight_sync on GPUs: CUDA IPC on one GPU, NCCL between two, against floors measured in the
same run and against the per-parameter way (one IPC handle and one round trip per parameter, as OpenRLHF does).

    python bench/weight_sync.py --mode ipc  --out ipc.json  [--model /path/to/hf/model]   # one GPU
    python bench/weight_sync.py --mode nccl --out nccl.json                                # two GPUs
    python bench/weight_sync.py --mode floor --out floor.json                              # floors only
    python bench/weight_sync.py --mode all --out all.json [--model PATH]                   # ipc, then nccl if 2 GPUs
    python bench/weight_sync.py --mode dryrun --out dry.json                               # CPU: gloo, plumbing only

Sender = this process (cuda:0); receiver = a spawned process (cuda:0 for ipc, cuda:1 for nccl) holding its own copy
of the weights and loading each received tensor with ``param.copy_`` (what ``HFEngine.load_weights`` does).
Model: a random-weight bf16 Llama of >= 1.5B parameters (names and shapes of HF's LlamaForCausalLM; hidden 2048,
28 layers, intermediate 5632, vocab 32000, full multi-head attention), and optionally ``--model`` (an HF folder).
Floor (ipc): one device-to-device copy of the model's bytes at the copy bandwidth measured here; the channel does two
copies (pack into a bucket, load out of it), so 2.0 is its structural minimum. Each variant: 2 warm-up syncs, then
``--repeats`` timed syncs (median reported); after them the weights are changed and synced once more, and the
receiver's checksum of everything it holds must equal the sender's (bitwise equality).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import threading
import time
import traceback
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhfkit.weight_sync import SyncEndpoint, WeightReceiver, WeightSender, WeightSyncConfig

GIB = 1024**3
MIB = 1024**2
TIMEOUT_S = 30.0  # every wait of the channel and of the bench on the receiver process
_STARTED = time.perf_counter()


def log(message: str) -> None:
    """A progress line, flushed at once (so a hang shows where it is)."""
    print(f"[{time.perf_counter() - _STARTED:6.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------- models
def llama_specs(hidden=2048, layers=28, intermediate=5632, vocab=32000) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names/shapes of HF LlamaForCausalLM (multi-head attention, untied embeddings)."""
    specs = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (hidden, hidden)),
                  (p + "self_attn.v_proj.weight", (hidden, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                  (p + "mlp.gate_proj.weight", (intermediate, hidden)),
                  (p + "mlp.up_proj.weight", (intermediate, hidden)),
                  (p + "mlp.down_proj.weight", (hidden, intermediate)), (p + "input_layernorm.weight", (hidden,)),
                  (p + "post_attention_layernorm.weight", (hidden,))]
    return specs + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def random_weights(specs, device, dtype=torch.bfloat16, seed=0) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
            for name, shape in specs}


def load_hf_weights(path, device) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    return {name: p.data for name, p in model.named_parameters()}


def nbytes_of(weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def fingerprint(weights) -> list[int]:
    """Per tensor: the sum of its 16-bit words (bf16 weights), each times its position; exact in int64."""
    sums = []
    for tensor in weights.values():
        words = tensor.detach().reshape(-1).view(torch.int16).to(torch.int64)
        sums.append(int((words * torch.arange(1, words.numel() + 1, device=words.device)).sum()))
    return sums


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------- floors
def copy_bandwidth(src_device, dst_device, nbytes, iters=10) -> float:
    """Bytes copied per second (each byte is read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    for _ in range(3):
        dst.copy_(src)
    sync_device(src_device), sync_device(dst_device)
    started = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync_device(src_device), sync_device(dst_device)
    seconds = (time.perf_counter() - started) / iters
    del src, dst
    return nbytes / seconds


def nccl_raw_broadcast(rank, port, device, nbytes, iters=5) -> float:
    """Bytes/s of a raw NCCL broadcast rank 0 -> rank 1 (each timed round ends with a 1-element reply)."""
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    torch.cuda.set_device(device)
    from rlhfkit.weight_sync._collective import _nccl_backend_class

    nccl = _nccl_backend_class()
    group = nccl(dist.PrefixStore("raw", store), rank, 2, nccl.Options())
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flag = torch.zeros(1, device=device)

    def bcast(tensor, root):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        group.broadcast([tensor], opts).wait()

    for _ in range(2):
        bcast(buffer, 0), bcast(flag, 1)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(iters):
        bcast(buffer, 0), bcast(flag, 1)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / iters
    store.set(f"raw-done/{rank}", b"1")
    store.wait([f"raw-done/{1 - rank}"])  # keep the store (owned by rank 0) alive until both are done
    if hasattr(group, "shutdown"):
        group.shutdown()
    return nbytes / seconds


# ---------------------------------------------------------------------------------------------------- receiver process
def per_parameter_receive(port, target, device, count, versions):
    """OpenRLHF's way, receiving side: per parameter, open its IPC handle, copy, synchronize, acknowledge."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    for version in versions:
        for i in range(count):
            name, (function, args) = pickle.loads(store.get(f"pp/{version}/{i}"))
            args = list(args)
            args[6] = device.index
            tensor = function(*args)
            target[name].copy_(tensor)
            torch.cuda.synchronize(device)
            del tensor
            store.set(f"pp/{version}/{i}/ack", b"1")


def pingpong(port, rounds):
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    for i in range(rounds):
        store.get(f"ping/{i}")
        store.set(f"pong/{i}", b"1")


def receiver_main(device_name, commands, replies):
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state: dict = {}
    while True:
        command, args = commands.get()
        if command == "quit":
            break
        try:
            replies.put(("ok", handle(command, args, state, device)))
        except Exception:  # reported to the sender process, which records it in the JSON
            replies.put(("error", traceback.format_exc()))


def handle(command, args, state, device):
    if command == "alloc":
        state["target"] = {name: torch.zeros(shape, dtype=torch.bfloat16, device=device) for name, shape in args}
        return nbytes_of(state["target"])
    if command == "load_model":
        state["target"] = load_hf_weights(args, device)
        return nbytes_of(state["target"])
    if command == "fingerprint":
        return fingerprint(state["target"])
    if command == "channel":
        endpoint, backend, count = args
        receiver = WeightReceiver(WeightSyncConfig(backend=backend, timeout_s=TIMEOUT_S), endpoint, device=device)
        target = state["target"]

        def load_fn(buckets):  # one batched copy per bucket (what a bucket-aware engine loader does)
            loaded = 0
            for bucket in buckets:
                torch._foreach_copy_([target[name] for name, _ in bucket], [view for _, view in bucket])
                loaded += len(bucket)
            return loaded

        try:
            reports = [receiver.receive(load_fn, by_bucket=True) for _ in range(count)]
            return [report.seconds for report in reports]
        finally:
            receiver.close()
    if command == "per_parameter":
        per_parameter_receive(args[0], state["target"], device, args[1], args[2])
        return True
    if command == "nccl_raw":
        return nccl_raw_broadcast(1, args[0], device, args[1])
    if command == "pingpong":
        return pingpong(*args)
    raise ValueError(f"unknown command {command!r}")


class Peer:
    """The receiver process and its command queues."""

    def __init__(self, device_name):
        context = mp.get_context("spawn")
        self.commands, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(target=receiver_main, args=(device_name, self.commands, self.replies),
                                       daemon=True)
        self.process.start()

    def call(self, command, args=None, timeout=300):
        self.start(command, args)
        return self.result(timeout)

    def start(self, command, args=None):
        self.commands.put((command, args))

    def result(self, timeout=300):
        status, value = self.replies.get(timeout=timeout)
        if status != "ok":
            raise RuntimeError(f"receiver process failed:\n{value}")
        return value

    def close(self):
        self.commands.put(("quit", None))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


# ---------------------------------------------------------------------------------------------------- measurements
def control_rtt_us(peer, rounds=200) -> float:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=TIMEOUT_S), wait_for_workers=False,
                          use_libuv=False)
    peer.start("pingpong", (store.port, rounds))
    time.sleep(0.5)
    started = time.perf_counter()
    for i in range(rounds):
        store.set(f"ping/{i}", b"1")
        store.get(f"pong/{i}")
    seconds = (time.perf_counter() - started) / rounds
    peer.result()
    return seconds * 1e6


def run_variant(peer, weights, backend, device, name, repeats, **config) -> dict:
    """Warm-up 2 + ``repeats`` timed syncs, then a changed-weights sync verified by checksums."""
    sender = WeightSender(WeightSyncConfig(backend=backend, timeout_s=TIMEOUT_S, **config),
                          SyncEndpoint(world_size=2, group_name=name.replace("/", "_")), device=device)
    total = 2 + repeats + 1
    peer.start("channel", (sender.endpoint.for_rank(1, "bench-receiver"), backend, total))
    result = {"variant": name, "config": {k: str(v) for k, v in config.items()}}
    try:
        seconds = []
        for i in range(2 + repeats):
            report = sender.send(weights.items())
            if i >= 2:
                seconds.append(report.seconds)
        first = next(iter(weights.values()))
        first.neg_()
        sender.send(weights.items())
        received = peer.result(timeout=TIMEOUT_S * 2)
        result.update(median_s=statistics.median(seconds), min_s=min(seconds), all_s=seconds,
                      receiver_median_s=statistics.median(received[2:-1]),
                      bitwise_equal=peer.call("fingerprint") == fingerprint(weights))
    except Exception as error:  # recorded; the next variant still runs
        result["error"] = f"{type(error).__name__}: {error}"
        try:
            peer.result(timeout=TIMEOUT_S * 2)
        except Exception as peer_error:  # the receiver's side of the same failure
            result["receiver_error"] = str(peer_error)[-2000:]
    finally:
        sender.close()
    return result


def per_parameter_baseline(peer, weights, repeats) -> dict:
    """OpenRLHF's way, sending side: per parameter clone, one IPC handle, one message, wait for the ack."""
    from torch.multiprocessing.reductions import reduce_tensor

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=TIMEOUT_S), wait_for_workers=False,
                          use_libuv=False)
    versions = list(range(2 + repeats))
    peer.start("per_parameter", (store.port, len(weights), versions))
    seconds = []
    for version in versions:
        started = time.perf_counter()
        for i, (name, tensor) in enumerate(weights.items()):
            clone = tensor.detach().clone()
            store.set(f"pp/{version}/{i}", pickle.dumps((name, reduce_tensor(clone))))
            store.get(f"pp/{version}/{i}/ack")
            del clone
        seconds.append(time.perf_counter() - started)
        torch.cuda.ipc_collect()
    peer.result()
    timed = seconds[2:]
    return {"median_s": statistics.median(timed), "min_s": min(timed), "all_s": timed,
            "bitwise_equal": peer.call("fingerprint") == fingerprint(weights)}


IPC_VARIANTS = [
    ("default (512MiB, 1 buffer)", dict()),
    ("512MiB x2", dict(num_buffers=2)),
    ("1GiB x2", dict(bucket_bytes=GIB, num_buffers=2)),
]
NCCL_VARIANTS = [
    ("default (512MiB, 1 buffer)", dict()),
    ("512MiB x2", dict(num_buffers=2)),
    ("256MiB x2", dict(bucket_bytes=256 * MIB, num_buffers=2)),
]


def bench_model(peer, weights, backend, device, variants, repeats, label, save=None, stop_on_error=False) -> dict:
    model_bytes = nbytes_of(weights)
    results = {"label": label, "num_params": sum(t.numel() for t in weights.values()), "bytes": model_bytes,
               "num_tensors": len(weights), "variants": []}
    for name, config in variants:
        log(f"{backend} {label} | {name}: starting")
        outcome = run_variant(peer, weights, backend, device, f"{label}/{name}", repeats, **config)
        if "median_s" in outcome:
            outcome["GBps"] = model_bytes / outcome["median_s"] / 1e9
        results["variants"].append(outcome)
        print(f"  {label:>10} | {name:<48} | " + (f"{outcome['median_s'] * 1e3:8.2f} ms  "
              f"{outcome['GBps']:7.1f} GB/s  equal={outcome['bitwise_equal']}" if "median_s" in outcome
              else f"ERROR {outcome['error'][:300]}"), flush=True)
        if save is not None:
            save()
        if stop_on_error and "error" in outcome:
            log("stopping this phase after the first failure (later variants would hit the same problem)")
            break
    return results


def best_of(results) -> dict | None:
    ok = [v for v in results["variants"] if "median_s" in v and v.get("bitwise_equal")]
    return min(ok, key=lambda v: v["median_s"]) if ok else None


def run_ipc(args, out) -> None:
    device = torch.device("cuda", 0)
    specs = llama_specs()
    weights = random_weights(specs, device)
    model_bytes = nbytes_of(weights)
    copy_bps = copy_bandwidth(device, device, min(model_bytes, 2 * GIB))
    floor_s = model_bytes / copy_bps
    out["ipc"] = {"floor": {"d2d_copy_GBps": copy_bps / 1e9, "d2d_read_plus_write_GBps": 2 * copy_bps / 1e9,
                            "one_copy_of_model_s": floor_s,
                            "definition": "floor = model bytes / copy bandwidth (one device-to-device copy)"}}
    print(f"d2d copy {copy_bps / 1e9:.0f} GB/s ({2 * copy_bps / 1e12:.2f} TB/s read+write); model "
          f"{model_bytes / 1e9:.2f} GB -> floor {floor_s * 1e3:.2f} ms", flush=True)
    peer = Peer("cuda:0")
    try:
        peer.call("alloc", specs)
        out["ipc"]["control_rtt_us"] = control_rtt_us(peer)
        big = bench_model(peer, weights, "cuda_ipc", device, IPC_VARIANTS, args.repeats, "llama-1.5B",
                          save=args.save)
        out["ipc"]["big_model"] = big
        gather = [("gathering source, 512MiB x1", dict()),
                  ("gathering source, 512MiB x2", dict(num_buffers=2))]
        big["gathering_source"] = bench_model(peer, GatheringSource(weights), "cuda_ipc", device, gather,
                                              args.repeats, "gathering")["variants"]
        log("ipc: per-parameter baseline")
        big["per_parameter"] = per_parameter_baseline(peer, weights, args.repeats)
        print(f"  per-parameter (OpenRLHF way): {big['per_parameter']['median_s'] * 1e3:.1f} ms", flush=True)
        summarize_ipc(big, floor_s)
        out["ipc"]["big_model"] = big
        del weights
        torch.cuda.empty_cache()
        if args.model:
            out["ipc"]["small_model"] = run_small_model(peer, args, device)
    finally:
        peer.close()


class GatheringSource(dict):
    """Yields a fresh copy of each tensor when asked, like a ZeRO-3 stream that gathers as it goes."""

    def items(self):
        return ((name, tensor.clone()) for name, tensor in super().items())


def run_small_model(peer, args, device) -> dict:
    weights = load_hf_weights(args.model, device)
    peer.call("load_model", args.model)
    generator = torch.Generator(device=device).manual_seed(1)
    for tensor in weights.values():  # the "trainer" moved away from the checkpoint
        tensor.add_(torch.randn(tensor.shape, generator=generator, device=device).to(tensor.dtype) * 1e-2)
    small = bench_model(peer, weights, "cuda_ipc", device, IPC_VARIANTS[:2], args.repeats, "small")
    small["model"] = args.model
    small["per_parameter"] = per_parameter_baseline(peer, weights, args.repeats)
    best = best_of(small)
    if best:
        small["speedup_vs_per_parameter"] = small["per_parameter"]["median_s"] / best["median_s"]
    return small


def summarize_ipc(big, floor_s) -> None:
    best = best_of(big)
    if best is None:
        return
    default = next((v for v in big["variants"] if v["variant"].endswith(IPC_VARIANTS[0][0])), {})
    big["best_variant"] = best["variant"]
    big["best_time_over_floor"] = best["median_s"] / floor_s
    if "median_s" in default:
        big["default_time_over_floor"] = default["median_s"] / floor_s
    big["speedup_vs_per_parameter"] = big["per_parameter"]["median_s"] / best["median_s"]
    print(f"  best {best['variant']}: {best['median_s'] * 1e3:.2f} ms = {big['best_time_over_floor']:.2f} x floor "
          f"(goal <= 3); per-parameter is {big['speedup_vs_per_parameter']:.1f} x slower (goal >= 5)", flush=True)


def run_nccl(args, out) -> None:
    """Our channel first (fresh processes, no other NCCL group before it), then the raw NCCL broadcast and the
    P2P copy floor; progress lines before each phase; partial results are saved after each."""
    if torch.cuda.device_count() < 2:
        out["nccl"] = {"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
        print(out["nccl"]["skipped"])
        return
    src, dst = torch.device("cuda", 0), torch.device("cuda", 1)
    torch.cuda.set_device(src)
    specs = llama_specs()
    weights = random_weights(specs, src)
    model_bytes = nbytes_of(weights)
    out["nccl"] = {}
    log("nccl: starting the receiver process on cuda:1")
    peer = Peer("cuda:1")
    try:
        peer.call("alloc", specs, timeout=120)
        log("nccl: receiver ready; channel variants (sender cuda:0 -> receiver cuda:1)")
        big = bench_model(peer, weights, "nccl", src, NCCL_VARIANTS, args.repeats, "llama-1.5B", save=args.save,
                          stop_on_error=True)
        out["nccl"]["big_model"] = big
        args.save()
        log("nccl: raw NCCL broadcast (1 GiB) between the same two processes")
        store_port = _free_port()
        peer.start("nccl_raw", (store_port, GIB))
        raw = nccl_raw_broadcast(0, store_port, src, GIB)
        peer.result(timeout=TIMEOUT_S * 2)
        out["nccl"]["raw_nccl_broadcast_GBps"] = raw / 1e9
        args.save()
        log("nccl: cuda:0 -> cuda:1 copy bandwidth")
        p2p = copy_bandwidth(src, dst, min(model_bytes, 2 * GIB))
        out["nccl"]["p2p_copy_GBps"] = p2p / 1e9
        print(f"cuda:0->cuda:1 copy {p2p / 1e9:.0f} GB/s; raw NCCL broadcast {raw / 1e9:.0f} GB/s", flush=True)
        best = best_of(big)
        if best:
            effective = model_bytes / best["median_s"]
            out["nccl"].update(best_variant=best["variant"], effective_GBps=effective / 1e9,
                               fraction_of_raw_nccl=effective / raw, fraction_of_p2p_copy=effective / p2p)
            print(f"  best {best['variant']}: {effective / 1e9:.0f} GB/s = {effective / raw:.2f} of raw NCCL, "
                  f"{effective / p2p:.2f} of the P2P copy", flush=True)
    finally:
        peer.close()


def _free_port() -> int:
    """A port outside the ephemeral range (nothing takes it before the group's rank 0 binds it)."""
    from rlhfkit._ports import free_listen_port

    return free_listen_port(host="127.0.0.1")


def run_floor(args, out) -> None:
    device = torch.device("cuda", 0)
    copy_bps = copy_bandwidth(device, device, 2 * GIB)
    out["floor"] = {"d2d_copy_GBps": copy_bps / 1e9, "d2d_read_plus_write_GBps": 2 * copy_bps / 1e9}
    if torch.cuda.device_count() >= 2:
        out["floor"]["p2p_copy_GBps"] = copy_bandwidth(device, torch.device("cuda", 1), 2 * GIB) / 1e9
    print(json.dumps(out["floor"], indent=1))


def run_dryrun(args, out) -> None:
    """CPU plumbing check: the same variants over gloo with a small model (no floors, no per-parameter way)."""
    device = torch.device("cpu")
    specs = llama_specs(hidden=128, layers=2, intermediate=256, vocab=1000)
    weights = random_weights(specs, device)
    peer = Peer("cpu")
    try:
        peer.call("alloc", specs)
        out["dryrun"] = bench_model(peer, weights, "gloo", device,
                                    [(n, dict(c, bucket_bytes=64 * 1024)) for n, c in NCCL_VARIANTS[:3]],
                                    args.repeats, "dryrun", save=args.save)
        out["dryrun"]["gathering"] = bench_model(peer, GatheringSource(weights), "gloo", device,
                                                 [("gathering", dict(bucket_bytes=64 * 1024))],
                                                 args.repeats,
                                                 "gathering")["variants"]
    finally:
        peer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["ipc", "nccl", "floor", "all", "dryrun"], required=True)
    parser.add_argument("--out", required=True, help="JSON results file (rewritten after every phase)")
    parser.add_argument("--model", default=None, help="an HF model folder for the small-model IPC run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=170.0,
                        help="hard limit of the whole run: past it, the partial JSON is written and the process exits")
    args = parser.parse_args()
    out = {"mode": args.mode, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "argv": sys.argv}
    lock = threading.Lock()

    def save() -> None:
        with lock:
            out["wall_s"] = time.perf_counter() - _STARTED
            with open(args.out, "w") as handle:
                json.dump(out, handle, indent=1, default=str)

    def give_up() -> None:  # runs in a timer thread: works even while the main thread is stuck in a C call
        out["error"] = f"deadline of {args.deadline_s:g}s passed; partial results"
        log(out["error"] + f"; writing {args.out} and exiting")
        save()
        os._exit(3)

    args.save = save
    timer = threading.Timer(args.deadline_s, give_up)
    timer.daemon = True
    timer.start()
    if args.mode != "dryrun":
        out["device"] = torch.cuda.get_device_name(0)
        out["num_gpus"] = torch.cuda.device_count()
    try:
        if args.mode in ("ipc", "all"):
            run_ipc(args, out)
        if args.mode in ("nccl", "all"):
            run_nccl(args, out)
        if args.mode == "floor":
            run_floor(args, out)
        if args.mode == "dryrun":
            run_dryrun(args, out)
    except Exception:  # keep what was measured; the traceback goes into the JSON
        out["error"] = traceback.format_exc()
        print(out["error"], file=sys.stderr)
    timer.cancel()
    save()
    print(f"wrote {args.out} ({out['wall_s']:.0f} s)")
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
