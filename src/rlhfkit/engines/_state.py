"""What every server-backed engine (vLLM, SGLang) keeps track of the same way (private; the engines subclass it).

The weight version, which wake tags are released, whether the weights are complete (a level-2 sleep discards them
until every weight has been rewritten), and the checks and messages built on those. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhfkit.engines.protocol import WAKE_TAGS

__all__ = ["EngineState"]


class EngineState:
    """Engine bookkeeping shared by the backends; ``engine_index`` is set by the subclass."""

    engine_index: int

    def _init_state(self) -> None:
        self._version = 0
        self._asleep: set[str] = set()  # tags currently released
        self._weights_valid = True
        self._invalid_reason = ""

    @property
    def weight_version(self) -> int:
        return self._version

    def get_weight_version(self) -> int:
        """:attr:`weight_version` as a method (Ray actors cannot read properties)."""
        return self._version

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        return tuple(tag for tag in WAKE_TAGS if tag in self._asleep)

    def _name(self) -> str:
        """How errors name this engine."""
        return f"engine {self.engine_index}"

    def _check_ready(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"{self._name()}: {what} called while {sorted(self._asleep)} asleep; call wake_up() "
                               "(all tags) first")
        if not self._weights_valid:
            raise RuntimeError(f"{self._name()}: {what} called but the weights are incomplete "
                               f"({self._invalid_reason}); load or sync every weight (load_weights / "
                               "receive_weights) first")

    def _check_weights_awake(self, what: str) -> None:
        if "weights" in self._asleep:
            raise RuntimeError(f"{self._name()}: {what} called while the weights are asleep; call "
                               "wake_up(tags=['weights']) first")

    def _check_sleep(self, level: int) -> None:
        """A valid level, and nothing asleep yet."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r}; expected 1 (keep weights in host memory) or 2 (discard them)")
        if self._asleep:
            raise RuntimeError(f"{self._name()}: sleep(level={level}) called while {sorted(self._asleep)} already "
                               "asleep; call wake_up() first")

    def _tags_to_wake(self, tags: Sequence[str] | None) -> list[str]:
        """The asleep tags among ``tags`` (None: all), in protocol order."""
        if tags is not None and (isinstance(tags, str) or any(tag not in WAKE_TAGS for tag in tags)):
            raise ValueError(f"tags={tags!r}; expected None or a list drawn from {list(WAKE_TAGS)}")
        return [tag for tag in (WAKE_TAGS if tags is None else tags) if tag in self._asleep]
