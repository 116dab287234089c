"""How a `standalone_compile` artifact reaches the graph Inductor compiled for it.

The artifact calls Inductor's `CompiledFxGraph` through a few wrappers (AOTAutograd's runtime wrapper, a
Dynamo-disabling one, ...), fresh or loaded from disk alike. Both the direct call of a piece's generated
code (`platforms/cpu/inductor.py`) and the piece report (`piece_report.py`) follow that chain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

# More wrappers than the pinned torch puts between an artifact and its graph: the walk stops there.
_MAX_WRAPPERS = 8


def closure_values(fn: Callable[..., Any]) -> dict[str, Any]:
    """The free variables of a Python function by name (empty for any other callable)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in cells), strict=True))


def wrapper_chain(artifact: Any) -> Iterator[Any]:
    """Each callable from the artifact's entry down to Inductor's `CompiledFxGraph`, that graph last where it
    is reached; the walk ends early at a callable whose next step it does not know."""
    from torch._functorch._aot_autograd.runtime_wrappers import SerializableCompiledFunction
    from torch._inductor.output_code import CompiledFxGraph

    fn = getattr(artifact, "_compiled_fn", None)
    for _ in range(_MAX_WRAPPERS):
        if fn is None:
            return
        yield fn
        if isinstance(fn, CompiledFxGraph):
            return
        if isinstance(fn, SerializableCompiledFunction):  # calls `compiled_fn`, keeps a way to save it
            fn = fn.compiled_fn
        else:
            fn = getattr(fn, "__wrapped__", None) or closure_values(fn).get("compiled_fn")


def compiled_fx_graph(artifact: Any) -> Any:
    """Inductor's `CompiledFxGraph` of a `standalone_compile` artifact, or None where it is not found."""
    from torch._inductor.output_code import CompiledFxGraph

    return next((fn for fn in wrapper_chain(artifact) if isinstance(fn, CompiledFxGraph)), None)
