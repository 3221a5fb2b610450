"""`evolve(state, **changes)`: a changed copy of a piece of the worker's stored state.

The state's dataclasses (streams.processor.RunState and everything it holds) are frozen,
have no `__slots__` (streams.codec) and no `__post_init__`, so a changed copy is a copy
of the instance's `__dict__` with the changes. `dataclasses.replace` looks up the fields
and goes through `__init__` on every call (2.0-4.5 us against 1.4-2.3 us for this in
timeit here, by the class), and the core makes several copies per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_FIELDS: dict[type, frozenset[str]] = {}


def _field_names(cls: type) -> frozenset[str]:
    found = _FIELDS.get(cls)
    if found is None:
        if not dataclasses.is_dataclass(cls) or "__slots__" in cls.__dict__ or hasattr(cls, "__post_init__"):
            raise TypeError(f"evolve: {cls.__name__} is not a stored-state dataclass (no slots, no __post_init__)")
        found = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return found


def evolve(obj: T, **changes: Any) -> T:
    """`dataclasses.replace(obj, **changes)` for stored-state dataclasses."""
    cls = type(obj)
    names = _FIELDS.get(cls) or _field_names(cls)
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field {sorted(changes.keys() - names)[0]!r}")
    new = _new(cls)
    _set(new, "__dict__", {**obj.__dict__, **changes})
    return new


_new = object.__new__
_set = object.__setattr__
