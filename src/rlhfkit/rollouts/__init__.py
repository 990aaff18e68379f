"""Asynchronous rollouts as two blocks of your own loop: a :class:`RolloutBuffer` with a staleness bound in policy
versions, and a :class:`RolloutProducer` thread that keeps it filled while the trainer trains.

What it does: the producer calls your ``generate_fn(prompts, weight_version)`` (or an
:class:`~rlhfkit.engines.router.EngineGroup`-like object's ``.generate(prompts, sampling)``) on batches from your
prompt iterator and puts each prompt's rollouts (one *group*: all ``n`` samples) into the buffer, stamped with
``current_version()`` read when the request started and given a group id of its own (``Rollout.prompt_index``, the
group's serial number in the buffer), so groups of different batches never merge in a group estimator. The trainer's
``buffer.get(num_groups, trainer_version=v)`` hands out only groups with ``v - weight_version <= max_staleness``.
Older groups are dropped and counted (``on_stale="drop"``), or the producer is held back before generating so that
they do not arise (``on_stale="wait"``, see :class:`RolloutBufferConfig`). Every wait is bounded and its timeout
names what was waited for; a producer's exception reaches the trainer's next ``get``; once every producer has
finished, a ``get`` the queue cannot fill raises :class:`RolloutBufferExhaustedError` at once;
:meth:`RolloutBuffer.close` wakes every waiter.

Versions per token: a rollout continued after an in-flight weight update (:meth:`rlhfkit.hybrid.Hybrid.push_weights`
with ``HybridConfig(overlap=True)``, :meth:`rlhfkit.engines.hf.HFEngine.pause_generation`) carries the version of each
token (``Rollout.response_weight_versions``); its group is stamped with the version at its request's start, the
oldest, so the bound is conservative, and :func:`token_staleness` and the ``token_staleness_*`` metrics count every
token at its own version.

What it does not do: correct for off-policy data (importance weights live in :mod:`rlhfkit.losses`), push weights,
or pause engines. Needs only torch.
"""

from __future__ import annotations

from rlhfkit.rollouts._buffer import (
                                      RolloutBuffer,
                                      RolloutBufferClosedError,
                                      RolloutBufferConfig,
                                      RolloutBufferExhaustedError,
                                      RolloutProducerError,
                                      RolloutTimeoutError,
                                      staleness,
                                      token_staleness,
)
from rlhfkit.rollouts._producer import RolloutProducer

__all__ = ["RolloutBuffer", "RolloutBufferClosedError", "RolloutBufferConfig", "RolloutBufferExhaustedError",
           "RolloutProducer", "RolloutProducerError", "RolloutTimeoutError", "staleness", "token_staleness"]
