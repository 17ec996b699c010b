"""Logical optimization (section 4): enumeration of interval requests and spec selection."""

from relational_tensors.dp_optimizer.enumerate import count_assignments, interval_requests

__all__ = ["interval_requests", "count_assignments"]
