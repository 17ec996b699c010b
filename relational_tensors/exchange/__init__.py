"""Exchange programs (section 5): the ExProg language, topologies, the simulator,
synthesis and lowering to a task DAG."""
