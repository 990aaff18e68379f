"""An in-process stand-in for :class:`rlhfkit.hybrid.Hybrid`, for example tests whose property does not depend on Ray
or DeepSpeed (the asynchronous loop's schedule, its sampling options, its roles, its failure handling).

``LocalHybrid.start(config, trainers)`` takes the example's real ``HybridConfig`` and ``TrainerConfig`` mapping and
builds, in this process: a real :class:`~rlhfkit.engines.hf.HFEngine` behind a real
:class:`~rlhfkit.engines.router.EngineGroup` (``hybrid.engines``), one plain-torch trainer per role
(``hybrid.trainers``: ``forward`` / ``forward_backward`` / ``optim_step`` over :func:`rlhfkit.losses.model_logprobs`,
fp32, AdamW with the role's learning rate and gradient clipping), a real :class:`~rlhfkit.hybrid.PhaseTimer`, and
``push_weights``: the engine's generation paused, the actor's weights loaded into it, generation resumed (what
``HybridConfig(overlap=True)`` does across processes). What it does not do: Ray, DeepSpeed, sleep/wake, micro-batching
or data parallelism; the shared CPU hybrid runs test those.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LocalHybrid", "LocalTrainer"]


class LocalTrainer:
    """One role's model in this process; the calls and stat names of :class:`rlhfkit.hybrid.TrainerGroup`."""

    def __init__(self, role: str, model: torch.nn.Module, *, learning_rate: float | None,
                 gradient_clipping: float) -> None:
        self.role, self.model, self.gradient_clipping = role, model, gradient_clipping
        self.optimizer = None if learning_rate is None else torch.optim.AdamW(model.parameters(), lr=learning_rate)
        self.global_step = 0

    def forward(self, batch, **_: Any) -> torch.Tensor:
        from rlhfkit.losses import model_logprobs

        with torch.no_grad():
            return model_logprobs(self.model, batch, loss_tokens_only=True).float()

    def forward_backward(self, minibatch, loss_fn, **_: Any) -> Any:
        from rlhfkit.hybrid import ForwardBackwardResult
        from rlhfkit.losses import model_logprobs

        if self.optimizer is None:
            raise RuntimeError(f"forward_backward() on '{self.role}', which has no optimizer")
        batch = minibatch.batch
        logprobs = model_logprobs(self.model, batch, loss_tokens_only=True)
        result = loss_fn(logprobs, minibatch, num_tokens=int(batch.loss_mask.sum()), num_seqs=int(batch.num_seqs))
        loss, stats = result if isinstance(result, tuple) else (result, {})
        loss.backward()
        return ForwardBackwardResult(role=self.role, loss=float(loss.detach()),
                                     stats={key: float(value) for key, value in stats.items()},
                                     num_tokens=int(batch.loss_mask.sum()), num_seqs=int(batch.num_seqs))

    def optim_step(self, **_: Any) -> Any:
        from rlhfkit.hybrid import OptimStepResult

        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return OptimStepResult(role=self.role, lr=float(self.optimizer.param_groups[0]["lr"]), grad_norm=float(norm),
                               global_step=self.global_step)


class LocalHybrid:
    """See the module docstring. ``kill_engine()`` makes the engine fail every later call (a dead engine process)."""

    def __init__(self, config: Any, trainers: Mapping[str, Any]) -> None:
        from transformers import AutoModelForCausalLM

        from rlhfkit.engines.hf import HFEngineConfig
        from rlhfkit.engines.router import EngineGroup, EngineGroupConfig
        from rlhfkit.hybrid._timer import GpuMemorySampler, PhaseTimer

        self.config = config
        self.timer = PhaseTimer(GpuMemorySampler(enabled=False))
        self.startup = {"total_s": 0.0}
        self.engine = _KillableHFEngine(HFEngineConfig(model=config.model, seed=config.seed))
        timeout = config.call_timeout_s
        self.engines = EngineGroup([self.engine], config=EngineGroupConfig(generate_timeout_s=timeout,
                                                                            control_timeout_s=timeout))
        self.trainers = {}
        for role, trainer in trainers.items():
            model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
            deepspeed = trainer.deepspeed
            self.trainers[role] = LocalTrainer(role, model, gradient_clipping=deepspeed.gradient_clipping,
                                               learning_rate=deepspeed.learning_rate if role == "actor" else None)
        self.closed = False

    @classmethod
    def start(cls, config: Any, trainers: Mapping[str, Any], *, plan: Any = None) -> LocalHybrid:
        return cls(config, trainers)  # in process: nothing to place, so the plan has nothing to decide

    def kill_engine(self) -> None:
        self.engine.dead = True

    def push_weights(self) -> dict[str, float]:
        """The actor's weights into the engine while its generation is parked; ``sync/version`` is the new one."""
        from rlhfkit.engines.router import EngineDiedError

        if self.engine.dead:
            raise EngineDiedError("engine 0 (of 1) died during load_weights", engine_index=0, method="load_weights")
        actor = self.trainers["actor"].model
        with self.timer.phase("weight_sync"):
            self.engine.pause_generation(timeout_s=self.config.sync_timeout_s)
            try:
                self.engine.load_weights((name, tensor.detach()) for name, tensor in actor.named_parameters())
            finally:
                self.engine.resume_generation()
        version = float(self.engine.weight_version)
        return {"sync/version": version, "engine/weight_version": version}

    def close(self) -> None:
        self.engines.close()
        self.closed = True


class _KillableHFEngine:
    """An HF engine whose calls fail once ``dead`` is set (what a killed engine process looks like to its caller)."""

    def __init__(self, config: Any) -> None:
        from rlhfkit.engines.hf import HFEngine

        self._engine, self.dead = HFEngine(config), False

    def generate(self, prompt_token_ids, sampling, *, prompt_indices=None):
        if self.dead:
            raise ConnectionError("the engine process is gone")
        return self._engine.generate(prompt_token_ids, sampling, prompt_indices=prompt_indices)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

