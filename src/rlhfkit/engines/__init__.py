"""Rollout engines: one protocol (:mod:`rlhfkit.engines.protocol`), several backends.

- :mod:`rlhfkit.engines.hf` — transformers, CPU or GPU, in-process (needs ``rlhfkit[hf]``).
- :mod:`rlhfkit.engines.vllm` — vLLM engines, in-process or as Ray actors (needs ``rlhfkit[vllm]``, ``rlhfkit[ray]``).
- :mod:`rlhfkit.engines.sglang` — an SGLang server per engine, driven over HTTP (sglang in an environment of its own).
- :mod:`rlhfkit.engines.router` — ``EngineGroup``: requests spread over engines (in-process or Ray actors).

Importing this package imports no backend.
"""

from rlhfkit.engines.protocol import RolloutEngine, SamplingConfig

__all__ = ["RolloutEngine", "SamplingConfig"]
