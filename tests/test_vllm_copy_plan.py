"""The recorded copy plan for vLLM weight loading (``weight_loading="planned"``), on CPU: a model whose loaders
narrow and copy the way vLLM's do (fused q/k/v and gate/up, a tensor-parallel slice of the source, a default loader),
plus loaders that transform or write a parameter with another op, which must stay on ``load_weights``. Expected values
come from a twin model loaded the plain way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhfkit.engines.vllm._copy_plan import CopyPlan
from rlhfkit.engines.vllm._worker import WeightSyncExtension

H = 4
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def stacked_loader(param, weight, shard):
    param.data.narrow(0, shard * H, H).copy_(weight)


class FusedModel(torch.nn.Module):
    """vLLM-like: fused parameters with weight_loaders; ``load_weights`` maps HF names and returns the parameter names
    it wrote. ``embed`` is this rank's half of a vocabulary-parallel embedding (rank 1 of 2: rows 3..5)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Parameter(torch.zeros(3 * H, H))
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(2 * H, H))
        self.o_proj = torch.nn.Parameter(torch.zeros(H, 2 * H))
        self.embed = torch.nn.Parameter(torch.zeros(3, H))
        self.norm = torch.nn.Parameter(torch.zeros(H))  # default loader: no weight_loader attribute
        self.scaled = torch.nn.Parameter(torch.zeros(H))  # its loader transforms: must stay unplanned
        self.padded = torch.nn.Parameter(torch.zeros(H + 2))  # its loader zero-fills first: a replayable constant
        self.embed.weight_loader = lambda param, weight: param.data.copy_(weight.narrow(0, 3, 3))
        self.o_proj.weight_loader = lambda param, weight: param.data.copy_(weight.t())  # a strided source view
        self.scaled.weight_loader = lambda param, weight: param.data.copy_(weight * 2)

        def pad_loader(param, weight):
            param.data.zero_()
            param.data[:H].copy_(weight)

        self.padded.weight_loader = pad_loader

    def load_weights(self, weights):
        written = set()
        for name, tensor in weights:
            key = name.split(".")[0]
            if key in STACKED:
                target, shard = STACKED[key]
                stacked_loader(getattr(self, target), tensor, shard)
                written.add(target)
                continue
            if key == "lm_head":  # tied to the embedding: vLLM skips it
                continue
            param = getattr(self, key)
            getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, tensor)
            written.add(key)
        return written


def hf_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q_proj.weight": (H, H), "k_proj.weight": (H, H), "v_proj.weight": (H, H), "gate_proj.weight": (H, H),
              "up_proj.weight": (H, H), "o_proj.weight": (2 * H, H), "embed.weight": (6, H), "norm.weight": (H,),
              "scaled.weight": (H,), "padded.weight": (H,), "lm_head.weight": (6, H)}
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes.values()), generator=generator)
    out, start = [], 0
    for name, shape in shapes.items():  # views of one buffer, like a zero-copy source
        size = torch.Size(shape).numel()
        out.append((name, flat[start : start + size].view(shape)))
        start += size
    return out


def test_plan_replays_copies_and_leaves_transforming_loaders_alone():
    model, twin = FusedModel(), FusedModel()
    plan = CopyPlan(model)
    first = hf_weights(0)
    written = set()
    # plain copies; the transforming loader; the zero-filling one; the skipped lm_head
    for part in (first[:8], first[8:9], first[9:10], first[10:]):
        written |= plan.record(part, model.load_weights)
    twin.load_weights(hf_weights(0))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    everything = {"qkv_proj", "gate_up_proj", "o_proj", "embed", "norm", "scaled", "padded"}
    assert written == everything
    assert plan.unplanned == {"scaled.weight", "lm_head.weight"}
    assert set(plan.steps) == {n for n, _ in first[:8]} | {"padded.weight"}
    assert len(plan.steps["q_proj.weight"]) == 1 and len(plan.fills["padded.weight"]) == 1
    second = hf_weights(1)
    with torch.no_grad():  # the weights were discarded (a level-2 sleep): the replay must rewrite everything
        for param in model.parameters():
            param.fill_(float("nan"))
    applied = plan.apply(second[:3], model.load_weights) | plan.apply(second[3:], model.load_weights)
    twin.load_weights(second)
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert applied == everything
    assert plan.valid()
    model.norm.data = torch.zeros(H)  # a parameter moved (e.g. re-allocated): the plan must be rebuilt
    assert not plan.valid()
    replaced = CopyPlan(model)
    assert replaced.valid()
    model.norm = torch.nn.Parameter(model.norm.detach().clone())  # a new parameter object: stale as well
    assert not replaced.valid()


def test_a_kept_mapping_reuses_its_source_views_and_copies_current_values():
    model, twin = FusedModel(), FusedModel()
    plan = CopyPlan(model)
    weights = hf_weights(0)[:8]  # views of one flat buffer, handed over again at every sync (a kept mapping)
    plan.record(weights, model.load_weights)
    plan.apply(weights, model.load_weights)
    cached = {name: plan._cut_sources(name, tensor) for name, tensor in weights}
    flat = weights[0][1].untyped_storage()
    assert plan._replay is not None and plan._replay.names == [name for name, _ in weights]
    cut = plan._cut_sources
    cuts: list = []
    plan._cut_sources = lambda *args: cuts.append(args) or cut(*args)  # a replayed batch cuts nothing
    for seed in (1, 2):  # the trainer writes new values into the same buffer
        fresh = hf_weights(seed)[:8]
        with torch.no_grad():
            for (_, view), (_, new) in zip(weights, fresh, strict=True):
                view.copy_(new)
        plan.apply(weights, model.load_weights)
        assert plan.last_replay == "foreach"  # (a CUDA graph only on CUDA)
        twin.load_weights(fresh)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)), seed
        assert all(plan._sources[id(tensor), name][1] is cached[name] for name, tensor in weights)  # cut once
    assert cuts == []  # both syncs replayed the whole batch: one list comparison and one foreach copy
    del plan._cut_sources
    assert weights[0][1].untyped_storage().data_ptr() == flat.data_ptr()
    # one tensor under two names (tied weights): each name gets the views cut for its own steps
    q_view = weights[0][1]
    plan.steps["alias.weight"] = [("norm", model.norm.data, 0, (H,), (1,))]
    plan.apply([("q_proj.weight", q_view), ("alias.weight", q_view)], model.load_weights)
    assert torch.equal(model.norm.data, q_view.reshape(-1)[:H]) and torch.equal(model.qkv_proj.data[:H], q_view)
    del weights, cached, view, q_view  # (the loop variable holds the last view too)
    assert len(plan._sources) == 0  # entries die with the tensors they were cut from
    assert plan._replay is None  # and so does the replay of a batch whose tensors are gone


def mapped_weights(seed: int) -> tuple[list[tuple[str, torch.Tensor]], torch.UntypedStorage]:
    """:func:`hf_weights` as a zero-copy receiver hands them over: each tensor built over the sender's mapped
    allocation with ``set_`` (a tensor of its own, not a view of another Python tensor), new objects at every sync."""
    weights = hf_weights(seed)
    storage = weights[0][1].untyped_storage()
    return [(name, torch.empty(0).set_(storage, view.storage_offset(), view.shape, view.stride()))
            for name, view in weights], storage


def test_the_plan_lets_go_of_a_sync_s_mapped_sources_once_they_are_dropped():
    """A zero-copy receiver that unmaps after each sync drops its tensors, and the sender can free that memory only
    once no view of it is left: the plan's cut source views must not keep the received tensors alive (a view made
    while autograd records keeps its base's Python object alive, and with it the weak reference that would drop the
    entry). Autograd stays on here: nothing on the receiving path turns it off."""
    import gc
    import weakref

    model, twin = FusedModel(), FusedModel()
    plan = CopyPlan(model)
    first, _ = mapped_weights(0)
    plan.record(first[:8], model.load_weights)
    del first
    for seed in (1, 2, 3):
        weights, storage = mapped_weights(seed)
        batch = weights[:8]
        plan.apply(batch, model.load_weights)
        twin.load_weights(batch)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)), seed
        assert plan._sources and plan._replay is not None
        alive = weakref.ref(batch[0][1])
        del weights, batch
        gc.collect()
        assert alive() is None, "a received tensor outlived its sync"
        assert len(plan._sources) == 0 and plan._replay is None, seed
        assert torch._C._storage_Use_Count(storage._cdata) == 1, seed  # only our handle: nothing else maps it


def test_a_write_from_a_temporary_unplans_its_whole_batch():
    model = FusedModel()
    plan = CopyPlan(model)
    weights = hf_weights(0)
    plan.record(weights[:4] + [weights[8]], model.load_weights)  # "scaled" copies from a temporary
    assert plan.unplanned == {n for n, _ in weights[:4]} | {"scaled.weight"} and plan.steps == {}


def test_a_fill_after_another_tensors_copy_is_not_planned():
    model = FusedModel()
    model.norm.weight_loader = lambda param, weight: param.data.copy_(weight)
    model.scaled.weight_loader = lambda param, weight: (param.data.copy_(weight), model.norm.data[:2].zero_())
    plan = CopyPlan(model)  # zeroing part of "norm" while loading "scaled": replaying fills first would lose it
    weights = hf_weights(0)
    plan.record(weights, model.load_weights)
    assert {"norm.weight", "scaled.weight"} <= plan.unplanned
    assert "q_proj.weight" in plan.steps  # the rest of the batch stays planned


def test_overlapping_destinations_are_not_planned():
    model = FusedModel()
    model.norm.weight_loader = lambda param, weight: param.data.copy_(weight)
    model.o_proj.weight_loader = lambda param, weight: (param.data.copy_(weight.t()), model.norm.data.copy_(
        weight[0]))  # writes norm too: two tensors' steps overlap in "norm"
    plan = CopyPlan(model)
    plan.record(hf_weights(0), model.load_weights)
    assert {"o_proj.weight", "norm.weight"} <= plan.unplanned


class PlannedWorker(WeightSyncExtension):
    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(model=FusedModel())
        self.rank = 0
        self.device = "cpu"


def test_worker_planned_sessions_record_then_replay():
    worker, twin = PlannedWorker(), FusedModel()
    for seed in (0, 1, 2):
        session = worker.rlhfkit_begin_weight_update("planned")
        assert session["planned"] and not session["layerwise"]
        weights = hf_weights(seed)
        assert worker.rlhfkit_load_weights(weights[:5]) == 5 and worker.rlhfkit_load_weights(weights[5:]) == 6
        report = worker.rlhfkit_finish_weight_update(seed + 1)
        assert report["planned"] and report["num_tensors"] == 11 and report["version"] == seed + 1
        twin.load_weights(weights)
        model = worker.model_runner.model
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)), seed
    plan = worker._rlhfkit_state()["plan"]  # batches [:5] (planned) and [5:] (holds a copy from a temporary)
    assert set(plan.steps) == {n for n, _ in hf_weights(0)[:5]}
    assert plan.unplanned == {n for n, _ in hf_weights(0)[5:]}


class BucketReceiver:
    """A receiver that hands its weights over bucket by bucket, like the IPC receivers do for planned loading."""

    def __init__(self, weights) -> None:
        self.weights = weights

    def receive(self, load, by_bucket=False):
        assert by_bucket
        count = load(iter([self.weights[:5], self.weights[5:]]))
        return {"num_tensors": count}


def test_worker_receive_reports_load_time_and_plan_size(monkeypatch):
    checks = []
    original = CopyPlan.valid
    monkeypatch.setattr(CopyPlan, "valid", lambda plan: checks.append(1) or original(plan))
    worker, twin = PlannedWorker(), FusedModel()
    for version, seed in ((3, 0), (4, 1)):
        worker._rlhfkit_state()["receiver"] = BucketReceiver(hf_weights(seed))
        report = worker.rlhfkit_receive_weights(version, "planned")
        assert report["version"] == version and report["planned"] and report["num_loaded"] == 11
        assert 0 < report["load_s"] <= report["receive_s"]
        assert (report["planned_tensors"], report["unplanned_tensors"]) == (5, 6)  # [5:] holds a copy from a temporary
        assert "plan_checked" not in report
    assert len(checks) == 1  # the plan's storage check runs once per update (the first built it), not per bucket
    twin.load_weights(hf_weights(1))
    model = worker.model_runner.model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_planned_falls_back_to_layerwise_where_auto_would(monkeypatch):
    from rlhfkit.engines.vllm import _worker as _vllm_worker

    walks = []
    original = _vllm_worker._repacked
    monkeypatch.setattr(_vllm_worker, "_repacked", lambda model: walks.append(1) or original(model))
    worker = PlannedWorker()
    assert worker._rlhfkit_layerwise("planned") is False and worker._rlhfkit_layerwise("auto") is False
    assert len(walks) == 1  # the model's modules are walked once, not at every update
    repacked = PlannedWorker()
    repacked.model_runner.model.qkv_proj_layer = torch.nn.Linear(2, 2)
    repacked.model_runner.model.qkv_proj_layer.quant_method = object()  # a repacked weight: no weight_loader
    assert repacked._rlhfkit_layerwise("planned") is True and repacked._rlhfkit_layerwise("auto") is True
    assert len(walks) == 2


def test_replay_mode_is_checked():
    with pytest.raises(ValueError, match="replay='auto'"):
        CopyPlan(FusedModel(), replay="auto")


def test_coalesce_copies_merges_runs_that_continue_each_other():
    from rlhfkit.engines.vllm._copy_plan import coalesce_copies

    flat = torch.randn(4 * H * H + H)
    qkv, other, norm = torch.zeros(3 * H, H), torch.zeros(H, H), torch.zeros(H)
    q, k, v, o = (flat[i * H * H:(i + 1) * H * H].view(H, H) for i in range(4))
    n = flat[4 * H * H:]
    transposed = torch.zeros(H, H)
    dsts = [qkv[:H], qkv[H:2 * H], qkv[2 * H:], other, norm, transposed]
    srcs = [q, k, v, o, n, o.t()]
    pairs = coalesce_copies(dsts, srcs)
    # q, k, v land back to back in qkv and come back to back from flat: one copy; o and norm go to other
    # allocations; the transposed source is not contiguous and stays as it is
    assert len(pairs) == 4
    assert pairs[0][0].numel() == 3 * H * H and pairs[0][0].data_ptr() == qkv.data_ptr()
    assert pairs[-1][1] is srcs[-1]
    for dst, src in pairs:
        dst.copy_(src)
    assert torch.equal(qkv, flat[:3 * H * H].view(3 * H, H)) and torch.equal(other, o) and torch.equal(norm, n)
    assert torch.equal(transposed, o.t())
    # a gap in the source breaks the run
    assert len(coalesce_copies([qkv[:H], qkv[H:2 * H]], [q, v])) == 2
    assert coalesce_copies([], []) == []


class ArmedBuckets:
    """An armed receiver: ``wait_for_sync`` returns once the test starts the sync; then buckets like BucketReceiver."""

    def __init__(self, weights) -> None:
        import threading

        self.weights, self.started, self.called_off = weights, threading.Event(), False

    def wait_for_sync(self, timeout_s=None):
        self.started.wait(10)
        return not self.called_off

    def call_off(self):
        if self.started.is_set():
            return False
        self.called_off = True
        self.started.set()
        return True

    def receive(self, load, by_bucket=False):
        assert by_bucket
        return {"num_tensors": load(iter([self.weights[:5], self.weights[5:]]))}


def test_an_armed_sync_checks_the_plan_when_armed_not_when_the_sync_starts(monkeypatch):
    worker, twin = PlannedWorker(), FusedModel()
    state = worker._rlhfkit_state()
    state["receiver"] = BucketReceiver(hf_weights(0))
    worker.rlhfkit_receive_weights(1, "planned")  # builds the plan
    checks = []
    original = CopyPlan.valid
    monkeypatch.setattr(CopyPlan, "valid", lambda plan: checks.append(len(checks)) or original(plan))
    state["receiver"] = receiver = ArmedBuckets(hf_weights(1))
    worker.rlhfkit_arm_weight_sync(2, "planned")
    assert checks == [0] and state["plan_checked"]  # checked while arming, before any sync started
    receiver.started.set()
    report = worker.rlhfkit_settle_weight_sync(10)
    assert report["version"] == 2 and checks == [0] and "plan_checked" not in state  # not checked again
    twin.load_weights(hf_weights(1))
    assert all(torch.equal(a, b) for a, b in zip(worker.model_runner.model.parameters(), twin.parameters(),
                                                 strict=True))
    # called off: the check is not carried over to the next update, which checks again
    state["receiver"] = ArmedBuckets(hf_weights(2))
    worker.rlhfkit_arm_weight_sync(3, "planned")
    assert worker.rlhfkit_settle_weight_sync(10) is None and "plan_checked" not in state
    worker.model_runner.model.norm.data = torch.zeros(H)  # a parameter moved while nothing was armed
    state["receiver"] = BucketReceiver(hf_weights(3))
    worker.rlhfkit_receive_weights(4, "planned")
    assert len(checks) == 3 and state["plan"].valid()  # the stale plan was dropped and a new one recorded


@pytest.mark.gpu
def test_a_replayed_batch_runs_as_one_cuda_graph_of_current_values():
    device = torch.device("cuda", 0)
    model, twin = FusedModel().to(device), FusedModel().to(device)
    plan = CopyPlan(model)
    flat = torch.cat([t.reshape(-1) for _, t in hf_weights(0)]).to(device)
    weights, start = [], 0  # views of one device buffer, handed over again at every sync (a kept mapping)
    for name, tensor in hf_weights(0):
        weights.append((name, flat[start:start + tensor.numel()].view(tensor.shape)))
        start += tensor.numel()
    planned = [w for w in weights if w[0] not in ("scaled.weight", "lm_head.weight")]
    plan.record(planned, model.load_weights)
    for seed in (1, 2, 3, 4):  # the trainer writes new values into the same buffer
        fresh = [(n, t.to(device)) for n, t in hf_weights(seed) if n not in ("scaled.weight", "lm_head.weight")]
        with torch.no_grad():
            for (_, view), (_, new) in zip(planned, fresh, strict=True):
                view.copy_(new)
            model.padded.fill_(float("nan"))  # the replayed fill must run too
        plan.apply(planned, model.load_weights)
        twin.load_weights(fresh)
        for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
            if name != "scaled":
                assert torch.equal(a, b), (seed, name)
        assert plan.last_replay == (None if seed == 1 else "graph"), seed  # remembered at 1, captured at 2
    with pytest.raises(ValueError, match="replay='cuda'"):
        CopyPlan(model, replay="cuda")
    foreach = CopyPlan(model, replay="foreach")
    foreach.record(planned, model.load_weights)
    foreach.apply(planned, model.load_weights)
    foreach.apply(planned, model.load_weights)
    assert foreach.last_replay == "foreach"
