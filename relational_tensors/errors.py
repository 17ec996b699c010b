"""The project's error family.

Every error names the rule that was broken, what was received (shapes, names,
sizes) and how to fix it.  Catch ``RelationalTensorsError`` to catch them all.
"""

from __future__ import annotations

__all__ = [
    "RelationalTensorsError",
    "GraphError",
    "SpecError",
    "PlanError",
    "OutOfMemoryPlanError",
    "ExchangeError",
    "ExecError",
    "CatalogError",
    "CommandError",
]


class RelationalTensorsError(Exception):
    """Root of every error raised by relational_tensors."""


class GraphError(RelationalTensorsError, ValueError):
    """A graph was built with inputs that break an operator's rules."""


class SpecError(RelationalTensorsError, ValueError):
    """A join-agg spec or an interval request is malformed."""


class PlanError(RelationalTensorsError):
    """No logical or physical plan satisfies the request."""


class CatalogError(PlanError):
    """A catalog file cannot be opened, read or written as asked (locked, not a catalog, names taken).

    A ``PlanError``: catalog errors were raised as one before this class existed."""


class OutOfMemoryPlanError(PlanError):
    """The plan would not fit in the memory of a device."""


class ExchangeError(RelationalTensorsError):
    """An exchange program is malformed or does not reach its OUT state."""


class ExecError(RelationalTensorsError):
    """A compiled program cannot be executed (missing inputs, absent hardware)."""


class CommandError(RelationalTensorsError):
    """A command line argument that names nothing usable: a missing file, an unknown operator."""
