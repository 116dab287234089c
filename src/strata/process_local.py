"""State that lives on a module for this process only and is never saved with it.

A saved compiled trace pickles the modules its guards read, `__dict__` included. Whatever such a module
holds for the running process (compiled pieces, a kernel's packed copy of a weight) must not go into the
file: it may not pickle at all, and a later process rebuilds it anyway.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ProcessLocal:
    """Base for objects that pickle as None."""

    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        return type(None), ()


class ProcessLocalValue(ProcessLocal, Generic[T]):
    """Holds a value for its owner's lifetime and pickles as None."""

    def __init__(self, value: T) -> None:
        self.value = value
