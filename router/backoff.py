"""Doubling delays between attempts, back to the first after a success.

The reconnect loops of the KV event streams, pod discovery and the index guard run for
the life of the process and start over after every healthy message; retry libraries
(tenacity, backoff) model a bounded run of attempts, not a delay that resets, so this
small state object is shared instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Backoff:
    first_s: float
    max_s: float
    current_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.current_s = self.first_s

    def next(self) -> float:
        """The delay to wait now; the next one doubles (up to ``max_s``)."""
        delay = self.current_s
        self.current_s = min(2 * delay, self.max_s)
        return delay

    def reset(self) -> None:
        self.current_s = self.first_s
