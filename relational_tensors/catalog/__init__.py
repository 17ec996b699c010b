"""The DuckDB catalog of graphs, candidate specs, costs, the DP table and plans."""

from relational_tensors.catalog.catalog import Catalog, load_sql

__all__ = ["Catalog", "load_sql"]
