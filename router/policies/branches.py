"""Where prompts part ways: the heads that several prompts continue differently.

A system prompt (or any common head) is followed by many different continuations; a
conversation's own history is followed by its next turns only. The cost policy tells
the two apart to decide whether a prompt whose cached part is such a head is a new
prefix (``CostParams.shared_head_share``): it notes, for the deepest block any pod holds
of each routed prompt, the block that came next, and a head whose next block differs
between two prompts is shared. Bounded: the least recently seen heads are forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

SHARED = -1  # a head seen with two different next blocks (block keys are unsigned)


class BranchPoints:
    """Heads (block keys) and the one next block seen after each, or ``SHARED``."""

    def __init__(self, max_heads: int = 65_536) -> None:
        self._next: OrderedDict[int, int] = OrderedDict()
        self._max = max_heads

    def __len__(self) -> int:
        return len(self._next)

    def shared(self, head: int, after: int) -> bool:
        """Whether another prompt continued ``head`` other than with ``after``; notes
        this continuation."""
        seen = self._next.get(head)
        if seen is None:
            self._next[head] = after
            if len(self._next) > self._max:
                self._next.popitem(last=False)
            return False
        self._next.move_to_end(head)
        if seen != after:  # another continuation, or already shared
            self._next[head] = SHARED
            return True
        return False


def after_shared_head(branches: BranchPoints, keys: Sequence[int], held: int) -> bool:
    """Whether the prompt (``keys``, of which some pod holds ``held`` leading blocks)
    leaves a head other prompts continued differently. Notes the continuation."""
    if held <= 0 or held >= len(keys):
        return False
    return branches.shared(keys[held - 1], keys[held])
