"""The tests' one walk over a traced program: every equation of a jaxpr, inside
scans, checkpoints, custom VJPs, conditionals and Pallas kernels' bodies too (any
sub-jaxpr in an equation's parameters), with its nesting depth.

Test code, not a test double: it lives beside the tests (tests/ is on sys.path
through tests/conftest.py), not in `tfjax/testing/`."""

from __future__ import annotations

from typing import Iterator


def equations(jaxpr, depth: int = 0) -> Iterator[tuple[object, int]]:
    """(equation, nesting depth: 0 at the top level) of `jaxpr` (a `jax.core.Jaxpr`,
    e.g. `jax.make_jaxpr(f)(x).jaxpr`), each equation before those inside it."""
    for eqn in jaxpr.eqns:
        yield eqn, depth
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    yield from equations(sub, depth + 1)


def of_primitive(jaxpr, name: str) -> list:
    """The equations of primitive `name` (e.g. "pallas_call") anywhere in `jaxpr`."""
    return [eqn for eqn, _ in equations(jaxpr) if eqn.primitive.name == name]
