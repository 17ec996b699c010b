"""The physical plan: lowering the logical plan to one task DAG (placement, exchange programs, buffers),
buffer liveness and peak memory, the whole-plan simulator and traces."""
