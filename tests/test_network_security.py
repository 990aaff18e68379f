"""The listeners rlhfkit opens, attacked from a second address.

Each network test makes a network namespace of its own joined to this one by a veth pair (addresses in
10.231.0.0/16, one /30 per test process): a process started inside the namespace is "another host" that can reach
this machine's host-side veth address and nothing else. Traffic only ever goes to that address and the namespace's
own. Needs root and ``ip`` (iproute2); skipped with the reason otherwise. The namespace is always deleted.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest
import torch
from _fake_cuda import FakeCudaOps

from rlhfkit.phase import PhaseGuard, TCPPhaseStore
from rlhfkit.weight_sync import (
    SyncEndpoint,
    WeightReceiver,
    WeightSender,
    WeightSyncConfig,
    WeightSyncError,
    describe_parameters,
)


@dataclass(frozen=True)
class Namespace:
    name: str
    host_ip: str  # this machine's end of the veth pair
    ns_ip: str  # the namespace's end


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    pid = os.getpid()
    name, host_if, ns_if = f"rlhfkit-sec-{pid}", f"rksh{pid % 10**8}", f"rksn{pid % 10**8}"
    block = pid % 16384
    base = f"10.231.{block // 64}.{(block % 64) * 4}".rsplit(".", 1)
    host_ip, ns_ip = f"{base[0]}.{int(base[1]) + 1}", f"{base[0]}.{int(base[1]) + 2}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot create a network namespace here: {error.stderr.strip()}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield Namespace(name, host_ip, ns_ip)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)  # gone with the namespace


def _from_namespace(ns: Namespace, code: str, params: dict, timeout_s: float = 120.0) -> dict:
    """Run ``code`` (reads ``params`` from argv[1] as JSON, prints one JSON line) inside the namespace."""
    done = subprocess.run(["ip", "netns", "exec", ns.name, sys.executable, "-c", code, json.dumps(params)],
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_CONNECT = """
import json, socket, sys
p = json.loads(sys.argv[1])
try:
    socket.create_connection((p["host"], p["port"]), timeout=5).close()
    print(json.dumps({"connected": True}))
except OSError as error:
    print(json.dumps({"connected": False, "error": str(error)}))
"""

# A client on "another host": reads and deletes the plain key names, writes forged values under them (and under every
# key the server lists, as a host that watched the traffic would know them), then reports what it read.
_ATTACK = """
import base64, datetime, json, sys
import torch.distributed as dist
p = json.loads(sys.argv[1])
store = dist.TCPStore(p["host"], p["port"], None, False, datetime.timedelta(seconds=20), use_libuv=False)
reads = {key: (base64.b64encode(store.get(key)).decode() if store.check([key]) else None) for key in p["read"]}
for key in p["delete"]:
    store.delete_key(key)
for key, value in p["write"].items():
    store.set(key, base64.b64decode(value))
listed = []
if p.get("overwrite_listed") and hasattr(store, "list_keys"):
    listed = [key for key in store.list_keys() if key not in p["write"]]
    for key in listed:
        store.set(key, base64.b64decode(p["overwrite_listed"]))
print(json.dumps({"reads": reads, "listed": len(listed)}))
"""


class _Marker:
    """Unpickling this creates ``path``: the proof that a value read from a socket was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _payload(path: str) -> str:
    return base64.b64encode(pickle.dumps(_Marker(path))).decode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --------------------------------------------------------------------------------------- (a), (b): loopback only
def test_weight_sync_store_on_loopback_refuses_another_address(netns):
    sender = WeightSender(WeightSyncConfig(backend="gloo", timeout_s=5), SyncEndpoint(world_size=2, group_name="sec"))
    try:
        port = sender.endpoint.port
        assert sender.endpoint.host == "127.0.0.1"
        seen = _from_namespace(netns, _CONNECT, {"host": netns.host_ip, "port": port})
        assert not seen["connected"], f"the control store of a loopback endpoint accepted {netns.ns_ip}"
    finally:
        sender.close()


def test_phase_store_on_loopback_refuses_another_address(netns):
    store = TCPPhaseStore.serve(timeout_s=10)
    seen = _from_namespace(netns, _CONNECT, {"host": netns.host_ip, "port": store.port})
    assert not seen["connected"], f"a phase store served on 127.0.0.1 accepted {netns.ns_ip}"
    PhaseGuard(store, gpu="g0").wake("rollout")  # and it still serves its own node
    assert pickle.loads(pickle.dumps(store)).holder("g0").startswith("rollout")


# --------------------------------------------------------------------------------------- (c): a node-address store
def test_phase_store_on_a_node_address_refuses_forged_claims(netns, tmp_path):
    """The multi-node case: the store listens on the address other hosts reach. A client without the secret finds no
    claim by its name, cannot clear it, and a claim it overwrites is refused with the typed error."""
    from rlhfkit.phase import PhaseStoreAuthenticationError

    store = TCPPhaseStore.serve(host=netns.host_ip, timeout_s=10)
    engine = PhaseGuard(pickle.loads(pickle.dumps(store)), gpu="gpu0")  # an engine actor's copy
    engine.wake("rollout")
    marker = tmp_path / "unpickled"
    key = "rlhfkit/phase/gpu0"
    seen = _from_namespace(netns, _ATTACK, {"host": netns.host_ip, "port": store.port, "read": [key],
                                            "delete": [key], "write": {key: _b64(b"actor\x1fattacker")},
                                            "overwrite_listed": _payload(str(marker))})
    assert seen["reads"] == {key: None}, "the attacker read the engine's claim by its name"
    assert seen["listed"] >= 1  # it found the (hashed) claim key and overwrote it
    with pytest.raises(PhaseStoreAuthenticationError, match="rlhfkit/phase/gpu0"):
        engine.awake_role()  # refused, not taken for "free" or for the attacker's role
    assert not marker.exists()


def _forged_ipc_sync(weights: dict, marker: str) -> dict[str, str]:
    """What an attacker writes under the plain key names of sync 1 of a cuda_ipc group: a start naming a manifest
    that matches the weights, a go-ahead, and an IPC handle message that runs code when unpickled."""
    from rlhfkit.weight_sync._manifest import Manifest, plan_buckets

    specs = tuple(describe_parameters(weights.items()))
    buckets, capacity = plan_buckets(specs, 4096)
    manifest = Manifest(version=1, specs=specs, buckets=buckets, capacity=capacity, generation=1).to_bytes()
    return {"1/start": _b64(manifest), "1/go": _b64(b'{"go": 1}'),
            "ipc/1": base64.b64encode(pickle.dumps(_Marker(marker))).decode()}


def test_weight_sync_store_on_a_node_address_refuses_forged_messages(netns, tmp_path, monkeypatch):
    """The multi-node case: the control store listens on the address other hosts reach. Forged messages under the
    protocol's key names (a manifest, a go-ahead, a pickled CUDA IPC handle message) are never seen; values forged
    under the keys the server lists are refused with the typed error; nothing is unpickled."""
    import rlhfkit.weight_sync
    import rlhfkit.weight_sync._ipc
    from rlhfkit.weight_sync import WeightSyncAuthenticationError

    monkeypatch.setattr(rlhfkit.weight_sync._ipc, "CudaOps", FakeCudaOps)
    monkeypatch.setattr(rlhfkit.weight_sync, "_resolve_device", lambda backend, device: torch.device("cpu"))
    config = WeightSyncConfig(backend="cuda_ipc", bucket_bytes=4096, timeout_s=10)
    torch.manual_seed(0)
    weights = {"a": torch.randn(64, 16), "b": torch.randn(300)}
    marker = tmp_path / "unpickled"
    sender = WeightSender(config, SyncEndpoint(host=netns.host_ip, world_size=2, group_name="sec"))
    endpoint = sender.endpoint
    receivers = []
    try:
        forged = _forged_ipc_sync(weights, str(marker))
        seen = _from_namespace(netns, _ATTACK, {"host": netns.host_ip, "port": endpoint.port,
                                                "read": ["hello/1", "formed"], "delete": [], "write": forged})
        assert seen["reads"] == {"hello/1": None, "formed": None}
        receiver = WeightReceiver(config, endpoint.for_rank(1, "engine-0"), expected=describe_parameters(
            weights.items()))
        receivers.append(receiver)
        loaded: dict = {}
        outcome: dict = {}

        def receive():
            try:
                outcome["report"] = receiver.receive(lambda items: loaded.update((n, t.clone()) for n, t in items))
            except Exception as error:  # collected for the assertions
                outcome["error"] = error

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        thread.join(1.0)  # the receiver is waiting for the sync (a forged one would be in its hands now)
        try:
            report = sender.send(weights.items())
        except WeightSyncError as error:  # asserted below, after the marker
            report = error
        thread.join(30)
        assert not thread.is_alive()
        assert not marker.exists(), "a forged CUDA IPC message was unpickled"
        assert "error" not in outcome, outcome
        assert not isinstance(report, Exception) and report.receiver_versions == (1,), report
        assert all(torch.equal(loaded[name], tensor) for name, tensor in weights.items())

        # a host that knows the (hashed) key names overwrites every value: nothing it wrote is accepted
        seen = _from_namespace(netns, _ATTACK, {"host": netns.host_ip, "port": endpoint.port,
                                                "read": ["hello/1", "formed", "1/done/1"], "delete": [],
                                                "write": {}, "overwrite_listed": _payload(str(marker))})
        assert seen["reads"] == {"hello/1": None, "formed": None, "1/done/1": None} and seen["listed"] >= 3
        restarted = WeightReceiver(config, endpoint.for_rank(1, "engine-0"))
        receivers.append(restarted)
        with pytest.raises(WeightSyncAuthenticationError, match="formed"):
            restarted.receive(lambda items: sum(1 for _ in items))
        assert not marker.exists()
    finally:
        for receiver in receivers:
            receiver.close()
        sender.close()


def test_a_receiver_needs_the_groups_secret():
    sender = WeightSender(WeightSyncConfig(backend="gloo", timeout_s=5), SyncEndpoint(world_size=2))
    try:
        endpoint = sender.endpoint
        assert endpoint.secret is not None and endpoint.for_rank(1).secret == endpoint.secret
        assert endpoint.secret.hex() not in repr(endpoint) and str(endpoint.secret) not in repr(endpoint)
        from dataclasses import replace

        with pytest.raises(ValueError, match="secret"):
            WeightReceiver(WeightSyncConfig(backend="gloo"), replace(endpoint.for_rank(1), secret=None))
        with pytest.raises(ValueError, match="secret"):
            TCPPhaseStore("127.0.0.1", endpoint.port)
    finally:
        sender.close()


# --------------------------------------------------------------------------------------- (d): the IPC handle codec
def _realistic_args() -> tuple:
    """``reduce_tensor(t)[1]`` of a CUDA bf16 parameter view, as torch builds it (built by hand: no CUDA here)."""
    return (torch.nn.Parameter, torch.Size([4, 8]), (8, 1), 16, torch.storage.TypedStorage, torch.bfloat16, 0,
            bytes(range(64)), 65536, 512, True, b"/torch_1234_5678_0", 24, bytes(range(64, 128)), True)


def test_ipc_handle_codec_round_trips_reduce_tensor_args_as_plain_json():
    from rlhfkit.weight_sync._handles import decode_tensor_args, encode_tensor_args

    args = _realistic_args()
    wire = json.dumps(encode_tensor_args(args))
    back = decode_tensor_args(json.loads(wire))
    assert back == args and [type(a) for a in back] == [type(a) for a in args]
    empty = args[:7] + (None, 0, 0, False, None, 0, None, None)  # an empty storage: no handles
    assert decode_tensor_args(json.loads(json.dumps(encode_tensor_args(empty)))) == empty


def test_ipc_handle_codec_refuses_pickles_and_unknown_classes(tmp_path):
    from rlhfkit.weight_sync._errors import WeightSyncProtocolError
    from rlhfkit.weight_sync._handles import decode_tensor_args, encode_tensor_args

    marker = tmp_path / "unpickled"
    good = encode_tensor_args(_realistic_args())
    bad = [
        {**good, "tensor_cls": "os.system"},
        {**good, "storage_cls": "builtins.eval"},
        {**good, "dtype": "__class__"},
        {**good, "size": [4, True]},
        {**good, "handle": "not base64!"},
        {**good, "requires_grad": 1},
        {**good, "extra": 1},
        _payload(str(marker)),
    ]
    for body in bad:
        with pytest.raises(WeightSyncProtocolError):
            decode_tensor_args(body)
    assert not marker.exists()
