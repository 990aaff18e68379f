"""The hybrid engine as blocks: trainer roles, rollout engines and a phase timer that time-share GPUs on Ray.

What it gives you (your script keeps the loop, the advantages, the minibatch loop and the loss):

- :func:`plan_hybrid` / :class:`HybridPlan` (:class:`RolePlan`, :class:`EnginePlan`): what stays on the GPU in which
  phase, decided once from the model, the GPU and the host, before anything starts; printable, editable.
- :class:`Hybrid` / :class:`HybridConfig`: start Ray, the GPU plan, engines and trainer processes; wire the weight
  sync; :meth:`Hybrid.push_weights` moves the actor's weights into the engines; :meth:`Hybrid.close`.
- :class:`TrainerGroup` / :class:`TrainerConfig`: one trainer role (actor, critic, reference, reward) over sleepable
  DeepSpeed engines, with the primitives ``forward``, ``forward_backward(minibatch, loss_fn)``, ``optim_step``,
  ``save``/``load``/``export``; guarded wake and sleep folded into each call (one call, one round trip).
- :class:`RolloutEngines`: ``generate`` (= ``sample``), ``sleep``/``wake`` under the phase guard, weight versions.
- :class:`ForwardBackwardResult`, :class:`OptimStepResult`: what the training primitives return; a
  :class:`CallObserver` (the :class:`PhaseTimer`) sees each call's :class:`CallRecord` of :class:`CallCost`\ s.
- :class:`PhaseTimer`, :class:`GpuMemorySampler`, :class:`MetricsLogger` (:mod:`rlhfkit.metrics`): per-phase time and
  peak GPU memory from any script; JSONL by default, Weights & Biases or TensorBoard when installed and asked for.
- :func:`save_checkpoint` / :func:`load_checkpoint` (:class:`RunCheckpoint`): a whole run's checkpoint (trained
  roles with their optimizers, the driver's RNG and state, the run's config) and its resume, in the order the phase
  guard and the weight sync need; :func:`export_model`: a role's weights as a ``from_pretrained``/``vllm serve``
  folder (LoRA: merged, plus the peft adapter).
- :func:`measure_copy_rates` / :class:`CopyRates`: the device's pinned host<->device copy rates, the floor the timer
  holds the phase switches' copied bytes against (``switch/floor_s``, ``switch/over_floor``).
- Errors naming role, rank and phase: :class:`HybridCallError`, :class:`RoleAsleepError`,
  :class:`LossFunctionError`, :class:`EnginesBusyError`.

What it does not do: own a loop, compute advantages or losses, or choose when to generate. Needs ``rlhfkit[ray]``
and ``rlhfkit[deepspeed]`` (and ``rlhfkit[vllm]`` for vLLM engines), imported when a run starts.
See ``docs/hybrid.md``.
"""

from rlhfkit.hybrid._checkpoint import RunCheckpoint, export_model, load_checkpoint, save_checkpoint
from rlhfkit.hybrid._copy_floor import CopyRates, measure_copy_rates
from rlhfkit.hybrid._engines import RolloutEngines
from rlhfkit.hybrid._errors import EnginesBusyError, HybridCallError, LossFunctionError, RoleAsleepError
from rlhfkit.hybrid._launch import Hybrid, HybridConfig, plan_for_machine
from rlhfkit.hybrid._plan import EnginePlan, HybridPlan, RolePlan, plan_hybrid
from rlhfkit.hybrid._results import CallCost, CallObserver, CallRecord, ForwardBackwardResult, OptimStepResult
from rlhfkit.hybrid._timer import GpuMemorySampler, PhaseTimer
from rlhfkit.hybrid._trainer import LossFn, TrainerConfig, TrainerGroup
from rlhfkit.metrics import MetricsLogger

__all__ = [
    "CallCost",
    "CallObserver",
    "CallRecord",
    "CopyRates",
    "EnginePlan",
    "EnginesBusyError",
    "ForwardBackwardResult",
    "GpuMemorySampler",
    "Hybrid",
    "HybridCallError",
    "HybridConfig",
    "HybridPlan",
    "LossFn",
    "LossFunctionError",
    "MetricsLogger",
    "OptimStepResult",
    "PhaseTimer",
    "RoleAsleepError",
    "RolePlan",
    "RolloutEngines",
    "RunCheckpoint",
    "TrainerConfig",
    "TrainerGroup",
    "export_model",
    "load_checkpoint",
    "measure_copy_rates",
    "plan_for_machine",
    "plan_hybrid",
    "save_checkpoint",
]
