"""The weight-sync channel: manifest/bucket layout by hand, the in-process path, gloo groups in threads (several receivers, failures on every side), gloo between real Ray actors (trainer →
HF engine), and CUDA IPC / NCCL between processes on GPUs."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from _fake_cuda import FakeCudaOps
from rlhfkit.weight_sync._manifest import Manifest, TensorSpec, compare_manifest, plan_buckets
from rlhfkit.weight_sync import (
    ManifestMismatchError,
    SyncEndpoint,
    WeightReceiver,
    WeightSender,
    WeightSyncAborted,
    WeightSyncConfig,
    WeightSyncError,
    WeightSyncTimeout,
    describe_parameters,
)


def make_weights(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Odd shapes on purpose: byte counts that are not multiples of 8, a 0-dim and an integer tensor."""
    generator = torch.Generator().manual_seed(seed)
    weights = {f"layers.{i}.w": torch.randn(37 + i, 19, generator=generator, dtype=dtype) for i in range(6)}
    weights["embed"] = torch.randn(500, 24, generator=generator, dtype=dtype)
    weights["odd_bf16"] = torch.randn(3, 7, generator=generator).to(torch.bfloat16)
    weights["scale"] = torch.tensor(1.5, dtype=dtype)
    weights["positions"] = torch.arange(11, dtype=torch.int64)
    return weights


def zeros_like(weights):
    return {name: torch.zeros_like(t) for name, t in weights.items()}


def copy_into(target: dict[str, torch.Tensor], seen: list | None = None):
    def load_fn(weights, version=None):
        count = 0
        for name, tensor in weights:
            target[name].copy_(tensor)
            count += 1
        if seen is not None:
            seen.append(version)
        return count

    return load_fn


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("field, value, needle", [
    ("backend", "mpi", "backend='mpi'"),
    ("bucket_bytes", 10, "bucket_bytes=10"),
    ("num_buffers", 3, "num_buffers=3"),
    ("timeout_s", 0, "timeout_s=0"),
    ("dtype", torch.int32, "dtype=torch.int32"),
])
def test_config_errors_name_field_and_value(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        WeightSyncConfig(**{field: value})


def test_endpoint_errors_and_roles():
    with pytest.raises(ValueError, match="world_size=1"):
        SyncEndpoint(world_size=1)
    with pytest.raises(ValueError, match="rank=3"):
        SyncEndpoint(world_size=3, rank=3)
    with pytest.raises(ValueError, match="group_name='a/b'"):
        SyncEndpoint(group_name="a/b")
    config = WeightSyncConfig(backend="gloo")
    with pytest.raises(ValueError, match="rank 0"):
        WeightSender(config, SyncEndpoint(rank=1))
    with pytest.raises(ValueError, match="port=0"):
        WeightReceiver(config, SyncEndpoint(rank=1))
    with pytest.raises(ValueError, match="local_receiver"):
        WeightSender(WeightSyncConfig(backend="inprocess"), SyncEndpoint())


# ---------------------------------------------------------------------------------------------------- manifest
def test_bucket_layout_by_hand():
    specs = [TensorSpec("a", (10,), torch.float32),      # 40 B -> 256
             TensorSpec("b", (100,), torch.float32),     # 400 B -> 512
             TensorSpec("c", (3000,), torch.bfloat16),   # 6000 B -> 6144, larger than a bucket: alone
             TensorSpec("d", (1,), torch.int64)]         # 8 B -> 256
    buckets, capacity = plan_buckets(specs, 1024)
    assert [(b.start, b.stop, b.offsets, b.payload_bytes) for b in buckets] == [
        (0, 2, (0, 256), 768), (2, 3, (0,), 6144), (3, 4, (0,), 256)]
    assert capacity == 6144 + 8
    manifest = Manifest(version=3, specs=tuple(specs), buckets=buckets, capacity=capacity)
    assert manifest.total_bytes == 40 + 400 + 6000 + 8
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest


def test_compare_manifest_names_each_problem():
    sent = [TensorSpec("w", (4, 2), torch.float32), TensorSpec("extra", (1,), torch.float32),
            TensorSpec("v", (3,), torch.bfloat16)]
    buckets, capacity = plan_buckets(sent, 4096)
    manifest = Manifest(version=1, specs=tuple(sent), buckets=buckets, capacity=capacity)
    expected = [TensorSpec("w", (2, 4), torch.float32), TensorSpec("v", (3,), torch.float32),
                TensorSpec("missing", (5,), torch.float32)]
    problems = compare_manifest(manifest, expected)
    assert len(problems) == 4
    assert "'w' has shape (4, 2) on the sender but the receiver expects (2, 4)" in problems[0]
    assert "'extra'" in problems[1] and "no such tensor" in problems[1]
    assert "'v' travels as bfloat16 but the receiver expects float32" in problems[2]
    assert "'missing'" in problems[3] and "not sent" in problems[3]
    assert compare_manifest(manifest, None) == []


def test_describe_parameters_uses_ds_shape_and_casts_floats():
    partitioned = torch.nn.Parameter(torch.zeros(0))
    partitioned.ds_shape = torch.Size([8, 4])
    specs = describe_parameters([("p", partitioned), ("i", torch.zeros(2, dtype=torch.int64))], dtype=torch.bfloat16)
    assert specs == [TensorSpec("p", (8, 4), torch.bfloat16), TensorSpec("i", (2,), torch.int64)]


def test_poll_until_and_run_bounded():
    from rlhfkit.weight_sync._collective import poll_until, run_bounded

    calls = []
    assert poll_until(lambda: calls.append(1) or len(calls) >= 3, time.monotonic() + 5)
    started = time.monotonic()
    assert not poll_until(lambda: False, started + 0.05)
    assert time.monotonic() - started >= 0.05
    assert run_bounded(lambda: 7, 1.0, lambda: AssertionError("not reached")) == 7
    with pytest.raises(KeyError, match="boom"):
        run_bounded(lambda: {}["boom"], 1.0, lambda: AssertionError("not reached"))
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="creating the NCCL communicator"):
        run_bounded(lambda: threading.Event().wait(120), 0.1,
                    lambda: WeightSyncTimeout("timed out creating the NCCL communicator"))
    assert time.monotonic() - started < 60  # a hang guard: it did not wait for the 120 s call


# ---------------------------------------------------------------------------------------------------- in-process
def test_inprocess_bitwise_cast_and_version():
    source = make_weights(0)
    target = zeros_like(source)
    for name in target:
        if target[name].is_floating_point():
            target[name] = target[name].to(torch.bfloat16)
    seen: list = []
    config = WeightSyncConfig(backend="inprocess", bucket_bytes=2048, dtype=torch.bfloat16)
    receiver = WeightReceiver(config, expected=describe_parameters(target.items()))
    sender = WeightSender(config, local_receiver=(receiver, copy_into(target, seen)))
    report = sender.send(source.items())
    expected = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in source.items()}
    assert_bitwise_equal(target, expected)
    assert report.num_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert (report.version, receiver.version, report.receiver_versions, seen) == (1, 1, (1,), [1])
    source["embed"].add_(1.0)
    assert sender.send(source).version == 2 and receiver.version == 2 and seen == [1, 2]
    assert torch.equal(target["embed"], source["embed"].to(torch.bfloat16))


def test_inprocess_mismatch_loads_nothing():
    source = make_weights(0)
    target = zeros_like(source)
    config = WeightSyncConfig(backend="inprocess", bucket_bytes=2048)
    expected = describe_parameters(target.items())
    expected[2] = expected[2]._replace(shape=(1, 2))
    receiver = WeightReceiver(config, expected=expected)
    sender = WeightSender(config, local_receiver=(receiver, copy_into(target)))
    with pytest.raises(ManifestMismatchError, match="'layers.2.w' has shape"):
        sender.send(source)
    assert all(not t.any() for t in target.values()) and receiver.version == 0
    receiver.expected = describe_parameters(target.items())
    assert sender.send(source).version == 2 and receiver.version == 2
    assert_bitwise_equal(target, source)


@pytest.mark.parametrize("case, error, needle", [
    ("order", ValueError, "yielded 'layers.1.w' at position 0"),
    ("missing", ValueError, "ended after 9 tensors"),
    ("extra", ValueError, "yielded 'surplus' after the 10 tensors"),
    ("shape", ValueError, "'embed' has shape \\(24, 500\\)"),
    ("partial_load", WeightSyncError, "taking 3 of the 10"),
])
def test_inprocess_stream_errors(case, error, needle):
    source = make_weights(0)
    description = describe_parameters(source.items())
    items = list(source.items())
    target = zeros_like(source)
    load_fn = copy_into(target)
    if case == "order":
        items[0], items[1] = items[1], items[0]
    elif case == "missing":
        items = items[:-1]
    elif case == "extra":
        items.append(("surplus", torch.zeros(1)))
    elif case == "shape":
        items = [(n, t.T if n == "embed" else t) for n, t in items]
    else:
        def load_fn(weights):
            return sum(1 for _, (_, _) in zip(range(3), weights))  # noqa: B905 (stops early on purpose)
    config = WeightSyncConfig(backend="inprocess", bucket_bytes=4096)
    receiver = WeightReceiver(config, expected=description)
    sender = WeightSender(config, local_receiver=(receiver, load_fn))
    with pytest.raises(error, match=needle):
        sender.send(iter(items), description=description)
    assert receiver.version == 0


# ---------------------------------------------------------------------------------------------------- threads
@pytest.fixture(params=["gloo", "cuda_ipc_on_cpu"])
def backend(request, monkeypatch):
    """A real gloo group, or the cuda_ipc protocol with FakeCudaOps, both in threads of this process."""
    if request.param == "gloo":
        return "gloo"
    import rlhfkit.weight_sync._ipc
    import rlhfkit.weight_sync

    monkeypatch.setattr(rlhfkit.weight_sync._ipc, "CudaOps", FakeCudaOps)
    monkeypatch.setattr(rlhfkit.weight_sync, "_resolve_device", lambda backend, device: torch.device("cpu"))
    return "cuda_ipc"


class Group:
    """A sender in this thread and receivers in threads of this process: one real group, fast."""

    def __init__(self, num_receivers=2, *, backend="gloo", expected=None, **config):
        config.setdefault("timeout_s", 10.0)
        self.config = WeightSyncConfig(backend=backend, **config)
        self.sender = WeightSender(self.config, SyncEndpoint(world_size=num_receivers + 1, group_name="t"))
        self.source = make_weights(0)
        self.targets = [zeros_like(self.source) for _ in range(num_receivers)]
        accepted = expected or [describe_parameters(self.source.items())] * num_receivers
        self.receivers = [WeightReceiver(self.config, self.sender.endpoint.for_rank(r + 1, f"engine-{r}"),
                                         expected=accepted[r]) for r in range(num_receivers)]

    def sync(self, load_fns=None, receive_kwargs=None, **send_kwargs):
        """Run one sync on every end; returns (sender result, [receiver results]); a result is a report or error."""
        results: list = [None] * len(self.receivers)

        def run(index):
            load_fn = (load_fns or {}).get(index) or copy_into(self.targets[index])
            try:
                results[index] = self.receivers[index].receive(load_fn, **(receive_kwargs or {}))
            except Exception as error:  # collected for the assertions
                results[index] = error

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(self.receivers))]
        for thread in threads:
            thread.start()
        try:
            sent = self.sender.send(send_kwargs.pop("stream", self.source.items()), **send_kwargs)
        except Exception as error:
            sent = error
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a receiver thread hung"
        return sent, results

    def close(self):
        for receiver in self.receivers:
            receiver.close()
        self.sender.close()


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_two_receivers_bitwise_and_versions(backend, num_buffers):
    group = Group(2, backend=backend, bucket_bytes=4096, num_buffers=num_buffers)
    try:
        sent, received = group.sync()
        assert sent.num_buckets >= 4 and sent.receiver_versions == (1, 1), sent
        assert all(r.version == 1 and r.loaded == len(group.source) for r in received)
        for target in group.targets:
            assert_bitwise_equal(target, group.source)
        group.source["layers.3.w"].mul_(-2)
        sent, received = group.sync()
        assert sent.version == 2 and sent.receiver_versions == (2, 2)
        for target in group.targets:
            assert_bitwise_equal(target, group.source)
        assert [r.version for r in group.receivers] == [2, 2]
    finally:
        group.close()


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_by_bucket_foreach_load_and_strided_cast_sources(backend, num_buffers):
    """by_bucket=True hands whole buckets (loaded with one _foreach_copy_); the sender's packing handles
    non-contiguous sources and a float32 -> bfloat16 cast bit for bit."""
    group = Group(2, backend=backend, bucket_bytes=4096, num_buffers=num_buffers, dtype=torch.bfloat16)
    group.targets = [{n: t.to(torch.bfloat16) for n, t in target.items()} for target in group.targets]
    for receiver in group.receivers:
        receiver.expected = describe_parameters(group.source.items(), dtype=torch.bfloat16)
    seen: list[list[list[str]]] = [[], []]

    def bucket_loader(index):
        def load_fn(buckets, version=None):
            for bucket in buckets:
                names = [name for name, _ in bucket]
                seen[index].append(names)
                torch._foreach_copy_([group.targets[index][n] for n in names], [view for _, view in bucket])
            return version
        return load_fn

    def strided(tensor):
        if tensor.dim() != 2:
            return tensor
        return torch.empty(tensor.shape[::-1], dtype=tensor.dtype).t().copy_(tensor)

    try:
        stream = [(name, strided(tensor)) for name, tensor in group.source.items()]
        assert any(not t.is_contiguous() for _, t in stream)
        sent, received = group.sync({0: bucket_loader(0), 1: bucket_loader(1)}, {"by_bucket": True}, stream=stream)
        assert not isinstance(sent, Exception), sent
        assert all(r.version == 1 and r.loaded == 1 for r in received), received
        for index, target in enumerate(group.targets):
            assert_bitwise_equal(target, {n: t.to(torch.bfloat16) for n, t in group.source.items()})
            assert len(seen[index]) == sent.num_buckets >= 4
            assert [n for names in seen[index] for n in names] == list(group.source)
    finally:
        group.close()


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_cuda_ipc_control_traffic(monkeypatch, num_buffers):
    """What crosses the control store in a CUDA IPC sync: one ready message per bucket; only acknowledgements the
    sender waits for (none for the last num_buffers buckets); the last sync's manifest is deleted during the next."""
    import rlhfkit.weight_sync._ipc
    import rlhfkit.weight_sync

    monkeypatch.setattr(rlhfkit.weight_sync._ipc, "CudaOps", FakeCudaOps)
    monkeypatch.setattr(rlhfkit.weight_sync, "_resolve_device", lambda backend, device: torch.device("cpu"))
    group = Group(2, backend="cuda_ipc", bucket_bytes=4096, num_buffers=num_buffers)
    store = group.sender._side.store

    def present(*keys):
        return [bool(store.check([key])) for key in keys]

    try:
        for version in (1, 2):
            sent, received = group.sync()
            assert sent.receiver_versions == (version, version), (sent, received)
            for target in group.targets:
                assert_bitwise_equal(target, group.source)
            assert sent.num_buckets >= 4
            assert present(*(f"{version}/b/{i}" for i in range(sent.num_buckets))) == [True] * sent.num_buckets
            acked = [i < sent.num_buckets - num_buffers for i in range(sent.num_buckets)]
            for rank in (1, 2):
                assert present(*(f"{version}/ack/{i}/{rank}" for i in range(sent.num_buckets))) == acked
            reports = [json.loads(store.get(f"{version}/done/{rank}")) for rank in (1, 2)]
            assert reports == [{"version": version}] * 2
            assert present(f"{version}/start", f"{version - 1}/start") == [True, False]
    finally:
        group.close()


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_a_receiver_that_changed_its_expectations_refuses_before_loading(backend, num_buffers):
    """Every sync's manifest is checked by every receiver before any byte moves: a receiver whose expectations
    changed since the last sync refuses, nothing is loaded anywhere, and the next sync goes through."""
    group = Group(2, backend=backend, bucket_bytes=4096, num_buffers=num_buffers)
    try:
        sent, _ = group.sync()
        assert sent.receiver_versions == (1, 1)
        before = [{k: v.clone() for k, v in target.items()} for target in group.targets]
        stricter = describe_parameters(group.source.items())
        stricter[2] = stricter[2]._replace(shape=(1, 1))
        group.source["layers.3.w"].mul_(-2)
        sent, received = group.sync(receive_kwargs={"expected": stricter})
        assert isinstance(sent, ManifestMismatchError) and "receiver rank 1 ('engine-0')" in str(sent), sent
        assert all(isinstance(r, ManifestMismatchError) for r in received), received
        for target, old in zip(group.targets, before, strict=True):
            assert_bitwise_equal(target, old)  # the refusing receivers loaded nothing
        sent, received = group.sync()
        assert sent.receiver_versions == (3, 3)
        for target in group.targets:
            assert_bitwise_equal(target, group.source)
    finally:
        group.close()


def test_manifest_mismatch_fails_everywhere_before_transfer(backend):
    source = make_weights(0)
    bad = describe_parameters(source.items())
    bad[4] = bad[4]._replace(dtype=torch.float16)
    group = Group(2, backend=backend, bucket_bytes=4096, expected=[describe_parameters(source.items()), bad])
    try:
        sent, received = group.sync()
        assert isinstance(sent, ManifestMismatchError) and "receiver rank 2 ('engine-1')" in str(sent)
        assert "'layers.4.w' travels as float32 but the receiver expects float16" in str(sent)
        assert isinstance(received[1], ManifestMismatchError) and "'layers.4.w'" in str(received[1])
        assert isinstance(received[0], ManifestMismatchError) and "'layers.4.w'" in str(received[0])
        assert all(not t.any() for target in group.targets for t in target.values())
        assert [r.version for r in group.receivers] == [0, 0]
        group.receivers[1].expected = describe_parameters(source.items())
        sent, received = group.sync()  # the group recovers
        assert sent.version == 2 and sent.receiver_versions == (2, 2)
        assert_bitwise_equal(group.targets[1], group.source)
    finally:
        group.close()


def test_sender_stream_error_aborts_receivers(backend):
    group = Group(2, backend=backend, bucket_bytes=4096)
    try:
        description = describe_parameters(group.source.items())
        first = next(iter(group.source))
        # a later bucket, and bucket 0
        for version, bad in ((1, "layers.5.w"), (2, first)):
            stream = [(n, t.T if n == bad else t) for n, t in group.source.items()]
            shape = tuple(group.source[bad].T.shape)
            sent, received = group.sync(stream=iter(stream), description=description)
            assert isinstance(sent, ValueError) and f"{bad!r} has shape {shape}" in str(sent), version
            for result in received:
                assert isinstance(result, WeightSyncAborted) and f"{bad!r} has shape {shape}" in str(result)
        sent, received = group.sync()
        assert sent.receiver_versions == (3, 3)
    finally:
        group.close()


def test_receiver_load_error_reaches_sender(backend):
    group = Group(2, backend=backend, bucket_bytes=4096)

    def failing(weights):
        for index, (name, _) in enumerate(weights):
            if index == 5:
                raise KeyError(f"engine has no slot for {name}")
        return 0

    try:
        sent, received = group.sync(load_fns={1: failing})
        assert isinstance(received[1], KeyError)
        assert isinstance(sent, WeightSyncError)
        assert "receiver rank 2 ('engine-1') of group 't' failed sync 1" in str(sent)
        assert "engine has no slot for layers.5.w" in str(sent)
        assert group.receivers[1].version == 0
        if backend == "gloo":  # the healthy receiver completes: broadcasts go on while the failed one drains
            assert received[0].version == 1
        else:  # cuda_ipc: the failure arrives with an acknowledgement, and the sender stops everyone
            assert isinstance(received[0], WeightSyncAborted) and "engine has no slot" in str(received[0])
        sent, received = group.sync()
        assert sent.receiver_versions == (2, 2)
    finally:
        group.close()


def test_timeouts_name_the_peer():
    config = WeightSyncConfig(backend="gloo", timeout_s=1.5)
    sender = WeightSender(config, SyncEndpoint(world_size=2, group_name="lonely"))
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="receiver rank 1 of group 'lonely'"):
        sender.send(make_weights(0))
    assert time.monotonic() - started < 60  # a hang guard: the 1.5 s timeout ended the wait
    receiver = WeightReceiver(config, sender.endpoint.for_rank(1))
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"the sender \(rank 0\) of group 'lonely'"):
        receiver.receive(copy_into(make_weights(0)))
    assert time.monotonic() - started < 60  # a hang guard: the 1.5 s timeout ended the wait
    receiver.close()
    sender.close()


# ---------------------------------------------------------------------------------------------------- Ray actors
@pytest.fixture(scope="module")
def ray_session(ray_cluster):
    """This process on the session's Ray cluster; the actor classes below (of this file) are pickled by value."""
    return ray_cluster


def _outcome(call):
    started = time.monotonic()
    try:
        report = call()
        return {"ok": True, "version": report.version, "versions": list(report.receiver_versions),
                "seconds": time.monotonic() - started}
    except Exception as error:  # returned to the test for assertions
        return {"ok": False, "type": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}


class TrainerActor:
    """Holds the 'trained' model (the tiny Llama, perturbed) and a sender; can tamper with what it sends."""

    def __init__(self, model_path, timeout_s):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(123)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        self.config = WeightSyncConfig(backend="gloo", bucket_bytes=64 * 1024, timeout_s=timeout_s)
        self.senders = {}

    def open(self, name, timeout_s=None):
        config = self.config if timeout_s is None else WeightSyncConfig(backend="gloo", bucket_bytes=64 * 1024,
                                                                        timeout_s=timeout_s)
        self.senders[name] = WeightSender(config, SyncEndpoint(world_size=2, group_name=name))
        return self.senders[name].endpoint

    def state(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def send(self, name, tamper=None):
        sender = self.senders[name]
        stream = [(n, p.detach()) for n, p in self.model.named_parameters()]
        target = "model.layers.0.mlp.up_proj.weight"
        if tamper == "name":
            stream = [(n + ".renamed" if n == target else n, t) for n, t in stream]
        elif tamper == "shape":
            stream = [(n, t.reshape(-1) if n == target else t) for n, t in stream]
        elif tamper == "dtype":
            stream = [(n, t.double() if n == target else t) for n, t in stream]
        return _outcome(lambda: sender.send(stream))


class EngineActor:
    """An HF rollout engine that receives weights through the channel."""

    def __init__(self, model_path, endpoint, timeout_s):
        from rlhfkit.engines.hf import HFEngine, HFEngineConfig

        self.engine = HFEngine(HFEngineConfig(model=str(model_path)))
        config = WeightSyncConfig(backend="gloo", timeout_s=timeout_s)
        self.receiver = WeightReceiver(config, endpoint,
                                       expected=describe_parameters(self.engine.model.named_parameters()))

    def receive(self):
        return _outcome(lambda: self.receiver.receive(self.engine.load_weights))

    def state(self):
        return {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}

    def versions(self):
        return self.receiver.version, self.engine.weight_version


class SlowReceiverActor:
    """A plain receiver whose load_fn takes its time (so it can be killed mid-transfer)."""

    def __init__(self, endpoint, names_shapes, delay_s):
        self.target = {n: torch.zeros(s) for n, s in names_shapes}
        self.receiver = WeightReceiver(WeightSyncConfig(backend="gloo", timeout_s=30), endpoint)
        self.delay_s = delay_s
        self.loaded = 0

    def progress(self):
        return self.loaded

    def receive(self):
        def load_fn(weights):
            for name, tensor in weights:
                time.sleep(self.delay_s)
                self.target[name].copy_(tensor)
                self.loaded += 1
            return self.loaded

        return _outcome(lambda: self.receiver.receive(load_fn))


@pytest.fixture(scope="module")
def trainer_and_engine(ray_session, tiny_llama_path):
    ray = ray_session
    trainer = ray.remote(num_cpus=0)(TrainerActor).remote(str(tiny_llama_path), 120.0)
    endpoint = ray.get(trainer.open.remote("main"), timeout=300)
    engine = ray.remote(num_cpus=0)(EngineActor).remote(str(tiny_llama_path), endpoint.for_rank(1, "hf-engine"),
                                                        120.0)
    yield trainer, engine
    ray.kill(engine)
    ray.kill(trainer)


def ray_sync(ray, trainer, engine, **send_kwargs):
    sent = trainer.send.remote("main", **send_kwargs)
    received = engine.receive.remote()
    return ray.get([sent, received], timeout=300)


@pytest.mark.ray
def test_ray_gloo_trainer_to_hf_engine(ray_session, trainer_and_engine):
    ray, (trainer, engine) = ray_session, trainer_and_engine
    before = ray.get(engine.state.remote(), timeout=300)
    trained = ray.get(trainer.state.remote(), timeout=300)
    assert any(not torch.equal(before[n], trained[n]) for n in trained)  # the trainer really moved its weights

    sent, received = ray_sync(ray, trainer, engine)
    assert sent["ok"] and received["ok"], (sent, received)
    assert_bitwise_equal(ray.get(engine.state.remote(), timeout=300), trained)
    assert sent["versions"] == [1] and ray.get(engine.versions.remote(), timeout=300) == (1, 1)

    for tamper, needle in [("name", "'model.layers.0.mlp.up_proj.weight.renamed'"),
                           ("shape", "'model.layers.0.mlp.up_proj.weight' has shape"),
                           ("dtype", "'model.layers.0.mlp.up_proj.weight' travels as float64")]:
        sent, received = ray_sync(ray, trainer, engine, tamper=tamper)
        for outcome in (sent, received):
            assert not outcome["ok"] and outcome["type"] == "ManifestMismatchError", outcome
            assert needle in outcome["message"], outcome["message"]
        assert ray.get(engine.versions.remote(), timeout=300) == (1, 1)  # nothing was loaded
    assert_bitwise_equal(ray.get(engine.state.remote(), timeout=300), trained)

    sent, received = ray_sync(ray, trainer, engine)
    assert sent["ok"] and sent["versions"] == [5] and ray.get(engine.versions.remote(), timeout=300) == (5, 5)
    assert_bitwise_equal(ray.get(engine.state.remote(), timeout=300), trained)


@pytest.mark.ray
def test_ray_killed_receiver_fails_sender_within_timeout(ray_session, trainer_and_engine):
    ray, (trainer, _) = ray_session, trainer_and_engine
    timeout_s = 6.0
    endpoint = ray.get(trainer.open.remote("doomed", timeout_s), timeout=300)
    shapes = [(n, tuple(t.shape)) for n, t in ray.get(trainer.state.remote(), timeout=300).items()]
    actor = ray.remote(num_cpus=0, max_concurrency=2)(SlowReceiverActor)
    receiver = actor.remote(endpoint.for_rank(1, "slow"), shapes, 0.2)
    assert ray.get(receiver.progress.remote(), timeout=300) == 0  # up and running
    received = receiver.receive.remote()
    sent = trainer.send.remote("doomed")
    deadline = time.monotonic() + 60
    while ray.get(receiver.progress.remote(), timeout=300) < 2:  # mid-transfer: loading tensors 0.2 s each
        assert time.monotonic() < deadline, "the receiver never started loading"
        time.sleep(0.1)
    ray.kill(receiver)
    outcome = ray.get(sent, timeout=timeout_s + 30)
    assert not outcome["ok"], outcome  # the ray.get bound above is the hang guard
    assert "receiver rank 1 ('slow')" in outcome["message"], outcome
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(received, timeout=30)


# ---------------------------------------------------------------------------------------------------- processes
def process_weights(seed, device):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights = {f"layers.{i}.w": torch.randn(512 + i, 1024, generator=generator) for i in range(12)}
    weights["embed"] = torch.randn(4000, 512, generator=generator)
    weights["odd"] = torch.randn(33, 17, generator=generator)
    return {n: t.to(device=device, dtype=torch.bfloat16) for n, t in weights.items()}


def as_bytes(tensor):
    """Plain bytes (a queue would pass a CPU tensor through shared memory that dies with the child)."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def receiver_process_main(endpoint, backend, device_name, results):
    """Child process: receive twice into zeros, send what it holds back as bytes."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    target = {n: torch.zeros_like(t) for n, t in process_weights(0, device).items()}
    receiver = WeightReceiver(WeightSyncConfig(backend=backend, timeout_s=120), endpoint,
                              device=device if backend == "nccl" else None,
                              expected=describe_parameters(target.items()))
    try:
        versions = [receiver.receive(copy_into(target)).version for _ in range(2)]
        results.put({"versions": versions, "state": {n: as_bytes(t) for n, t in target.items()}})
    except Exception as error:  # reported to the parent test
        results.put({"error": f"{type(error).__name__}: {error}"})
    finally:
        receiver.close()


def run_process_pair(backend, sender_device, receiver_device, **config):
    """Sender here, receiver in a spawned process: two syncs (the second after changing every tensor)."""
    context = torch.multiprocessing.get_context("spawn")
    sender = WeightSender(WeightSyncConfig(backend=backend, timeout_s=120, **config),
                          SyncEndpoint(world_size=2, group_name=backend),
                          device=sender_device if backend != "gloo" else None)
    results = context.Queue()
    child = context.Process(target=receiver_process_main, args=(sender.endpoint.for_rank(1, "child"), backend,
                                                                 receiver_device, results))
    child.start()
    try:
        source = process_weights(0, torch.device(sender_device))
        assert sender.send(source.items()).receiver_versions == (1,)
        for tensor in source.values():
            tensor.mul_(-1.5)
        assert sender.send(source.items()).receiver_versions == (2,)
        outcome = results.get(timeout=300)
        assert "error" not in outcome, outcome
        assert outcome["versions"] == [1, 2]
        sent = {n: as_bytes(t) for n, t in source.items()}
        assert outcome["state"].keys() == sent.keys()
        assert [n for n in sent if outcome["state"][n] != sent[n]] == []
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        sender.close()


def test_gloo_two_processes_bitwise():
    run_process_pair("gloo", "cpu", "cpu", bucket_bytes=4 * 1024**2, num_buffers=2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_buffers", [1, 2])
def test_cuda_ipc_two_processes_one_gpu_bitwise(num_buffers):
    run_process_pair("cuda_ipc", "cuda:0", "cuda:0", bucket_bytes=4 * 1024**2, num_buffers=num_buffers)


@pytest.mark.gpu
def test_nccl_gpu0_to_gpu1_bitwise():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    run_process_pair("nccl", "cuda:0", "cuda:1", bucket_bytes=4 * 1024**2, num_buffers=2)


def test_restarted_receiver_is_refused_with_a_rejoin_error():
    """Review defect 4: a receiver restarted into an existing group failed after the timeout with "not every member
    joined"; it now fails at once with WeightSyncRejoinError saying to open a new group."""
    from rlhfkit.weight_sync import WeightSyncRejoinError

    group = Group(1, backend="gloo", bucket_bytes=4096, timeout_s=5.0)
    try:
        sent, received = group.sync()
        assert sent.version == 1 and received[0].version == 1
        group.receivers[0].close()  # the engine process dies ...
        restarted = WeightReceiver(group.config, group.sender.endpoint.for_rank(1, "engine-0"))  # ... and comes back
        with pytest.raises(WeightSyncRejoinError, match=r"receiver rank 1 .*cannot join group 't' .* already formed"
                                                        r".*cannot be re-joined: .*open a new group"):
            restarted.receive(copy_into(zeros_like(group.source)))
        restarted.close()
    finally:
        group.close()


def test_receiver_refuses_a_version_that_is_not_newer():
    """Review defect 2 (weight-sync receiver): a sync whose version is not newer than the receiver's is refused
    before anything loads, on both ends."""
    from rlhfkit.weight_sync import WeightSyncVersionError

    source, target = make_weights(0), zeros_like(make_weights(0))
    receiver = WeightReceiver(WeightSyncConfig(backend="inprocess"))
    sender = WeightSender(WeightSyncConfig(backend="inprocess"), local_receiver=(receiver, copy_into(target)))
    sender.send(source.items())
    second = WeightSender(WeightSyncConfig(backend="inprocess"), local_receiver=(receiver, copy_into(target)))
    source["layers.3.w"].add_(1)
    with pytest.raises(WeightSyncVersionError, match="holds weight version 1 and was offered version 1"):
        second.send(source.items())
    assert receiver.version == 1 and not torch.equal(target["layers.3.w"], source["layers.3.w"])
