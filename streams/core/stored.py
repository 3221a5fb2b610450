"""The base of the stream worker's stored state: `Stored`, and `Pairs`, the mappings it holds.

Every class of the worker's state (areal_metrics.streams.core.processor.RunState and what it
holds) is a `Stored`: a frozen msgspec Struct, compared by value, hashable when its fields
are, changed with `replace(state, **changes)` (msgspec.structs.replace) and encoded and
decoded by its type in areal_metrics.streams.state.codec. `gc=False`: a frozen state only refers
to values that existed before it, so it is never part of a reference cycle and the garbage
collector need not track it.

A mapping in the state is a `Pairs` (types.MappingProxyType): read-only like the rest of the
state, and a type of its own, so the codec writes it as a JSON array of [key, value] pairs
(keys may be structs or tuples: nothing is ever parsed out of a string). A class with mapping
fields wraps a plain dict given for one in its `__post_init__` (`hold_pairs`; the dict is
not copied: whoever builds a state does not change the dict afterwards).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import msgspec
from msgspec.structs import force_setattr

Pairs = MappingProxyType
NO_PAIRS: Pairs[Any, Any] = Pairs({})  # the empty mapping, shared (nothing can change it)


class Stored(msgspec.Struct, frozen=True, gc=False):
    """A class of the worker's stored state."""


def hold_pairs(state: Stored, *names: str) -> None:
    """In `__post_init__`: the fields `names` of `state` hold a Pairs, whatever mapping was given."""
    for name in names:
        value = getattr(state, name)
        if type(value) is not Pairs:
            force_setattr(state, name, Pairs(value if type(value) is dict else dict(value)))
