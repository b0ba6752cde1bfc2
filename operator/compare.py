"""Does a live object already say what we would apply? (pure)

Server-side apply owns exactly the fields it sends, so a live object is up to date
when every field of the desired manifest is there with the same value; fields the
API server defaults or other managers set are not ours to compare. Quantities are
compared by value, as the API server canonicalises them (``1024Mi`` is stored as
``1Gi``). The operator writes only what fails this check, which is what makes a
pool at rest cost no request.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, Final

_SUFFIX: Final[dict[str, Decimal]] = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


def quantity(text: str) -> Decimal | None:
    """The value of a Kubernetes quantity (``500m``, ``1Gi``, ``1e3``), or None."""
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number = text[: -len(suffix)]
            break
    else:
        suffix, number = "", text
    if not number or number[0] not in "+-.0123456789":
        return None
    try:
        return Decimal(number) * _SUFFIX[suffix]
    except InvalidOperation:
        return None


def _same_scalar(live: Any, desired: Any) -> bool:
    if live == desired:
        return True
    if isinstance(live, str) and isinstance(desired, str):
        a, b = quantity(live), quantity(desired)
        return a is not None and a == b
    if isinstance(live, str) and isinstance(desired, int | float) and not isinstance(desired, bool):
        return quantity(live) == Decimal(str(desired))  # a number sent for a quantity
    return False


def _is_zero(value: Any) -> bool:
    return value is False or value == 0 or value == "" or value == [] or value == {}


def covers(live: Any, desired: Any) -> bool:
    """True when ``live`` holds every field of ``desired`` with an equal value.

    Maps: each desired key present and covered (``None`` means absent; an empty or
    false value may be absent, as the API server omits zero values). Lists: the same
    length, item by item (our lists are atomic or keyed in render order).
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        for key, value in desired.items():
            if value is None:
                if live.get(key) is not None:
                    return False
            elif key not in live:
                if not _is_zero(value):
                    return False
            elif not covers(live[key], value):
                return False
        return True
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(covers(a, b) for a, b in zip(live, desired, strict=True))
        )
    return _same_scalar(live, desired)
