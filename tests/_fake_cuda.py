"""A stand-in for the CUDA calls of rlhfkit.weight_sync's cuda_ipc transport, shared by its CPU tests."""

from __future__ import annotations

import torch


class FakeCudaOps:
    """CUDA IPC's CUDA calls for threads of one CPU process: a 'handle' is a key into a registry of shared
    tensors, events are no-ops (all copies are synchronous). Everything else — control messages, slots, acks,
    fingerprints, aborts — is the real cuda_ipc protocol."""

    shared: dict = {}

    def uuid(self, device):
        return "fake-gpu"

    def device_of_uuid(self, uuid):
        assert uuid == "fake-gpu"
        return torch.device("cpu")

    def share(self, tensor):
        FakeCudaOps.shared[id(tensor)] = tensor
        return id(tensor)

    def open(self, handle, device):
        return FakeCudaOps.shared[handle]

    def new_events(self, count, device):
        return [None] * count

    def event_handle(self, event):
        return b"event"

    def open_event(self, handle, device):
        return None

    def record(self, event, device):
        pass

    def wait(self, event, device):
        pass

    def synchronize(self, device):
        pass

    def event_synchronize(self, event):
        pass
