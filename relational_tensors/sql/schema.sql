-- The catalog: one row set per compilation, so one persisted file can hold many
-- compilations and compare them with plain SQL.  Element counts are the paper's
-- unit; *_bytes columns weigh them by dtype width.
--
-- Only CREATE ... IF NOT EXISTS here: a file written by an older version gains the tables and
-- columns it lacks when it is next opened for writing (relational_tensors/catalog/catalog.py adds
-- missing columns with their DEFAULT, then runs the data steps of each newer catalog version).

-- one row per catalog version a file was created at or migrated to; the newest is the file's
CREATE TABLE IF NOT EXISTS catalog_version (
    version   INTEGER,                        -- the catalog version the file was created at or migrated to
    package   VARCHAR,              -- relational_tensors: marks the file as a catalog of this project
    applied   TIMESTAMP,                      -- when
    note      VARCHAR               -- created, or what the migration added
);

CREATE SEQUENCE IF NOT EXISTS compilation_seq START 1;

-- one row per compilation: how it was planned, what it cost, whether it made a plan
CREATE TABLE IF NOT EXISTS compilations (
    compilation_id     INTEGER PRIMARY KEY,
    created            TIMESTAMP,             -- when the compilation started
    label              VARCHAR,     -- a name the user gave, or the graph's output names
    devices            INTEGER,     -- p, the number of function specs per join-agg spec
    device             VARCHAR,     -- what the device argument named (cpu:8, cuda:0,1, ...)
    selector           VARCHAR,     -- dp | greedy | random
    seed               INTEGER,               -- the seed of the random selector and of the exchange search
    cost_model         VARCHAR,     -- paper | bytes | calibrated
    memory_per_device  BIGINT,                -- the bytes each device may use (the least over the devices)
    plan_cost          DOUBLE,                -- the chosen plan's cost under cost_model, in cost_unit
    planning_seconds   DOUBLE,                -- the seconds the passes took
    status             VARCHAR,     -- ok | refused (no plan fits the memory) | failed; NULL while planning
                                    -- (or when the process ended before the compilation finished)
    error              VARCHAR,     -- the error that refused or failed it
    topology           VARCHAR,     -- the machine planned for (hgx-h200, dgx-a100, a topology file's name)
    schedule_mode      VARCHAR,     -- naive | search
    tactic             VARCHAR,     -- tree | linear
    calibration        VARCHAR,     -- the kernel rates' source (a calibration file, or the topology's defaults)
    keep_states        VARCHAR,     -- auto | as read | sharded
    graph_fingerprint  VARCHAR,     -- sha256 of the whole graph, names included: equal graphs, equal fingerprint
    version            VARCHAR,     -- the relational_tensors version that planned it
    cost_unit          VARCHAR,     -- plan_cost's unit: elements (paper) | bytes | seconds (calibrated)
    predicted_seconds  DOUBLE,      -- the simulated time of one execution on topology (NULL until simulated)
    peak_bytes         BIGINT,      -- the largest per-device peak of the plan
    memory_limit       BIGINT,      -- the memory_per_device option in bytes (NULL: planned against each device's own memory)
    stages             INTEGER,     -- pipeline stages: groups of consecutive devices, each running its operators (1: none)
    micro_batches      INTEGER,     -- slices of the batch each stage runs in sequence (1: the whole batch at once)
    pipeline_schedule  VARCHAR      -- the order of the micro-batches' forward and backward: gpipe | 1f1b (NULL: no pipeline)
);

-- the operator registry each compilation was planned with (relational_tensors.driver.registry)
CREATE TABLE IF NOT EXISTS operator_kinds (
    compilation_id  INTEGER,
    kind            VARCHAR,        -- the operator kind (operators.op_kind)
    op_class        VARCHAR,                  -- the Python class declaring it
    module          VARCHAR,        -- where the operator is declared
    aggregation     VARCHAR,        -- its ⊕ (per op: chosen by the operator's parameters)
    cost_family     VARCHAR,        -- how the kernel model prices it: matmul | attention | compute
    numpy_kernel    BOOLEAN,                  -- it has a NumPy kernel (virtual CPU devices)
    gpu_launcher    BOOLEAN,                  -- it has a GPU launcher
    gpu_allocates   BOOLEAN,        -- its GPU kernel allocates (keeps a program out of CUDA-graph capture;
                                    -- NULL: each operator's parameters decide)
    gradient        VARCHAR,        -- 'yes' where it declares its vector-Jacobian product, else why not
    gpu_form        VARCHAR         -- where it runs on GPUs: 'kernel' (device kernels, captured), 'kernel except
                                    -- <forms>' or 'host: <forms>' (on host copies or allocating CuPy code)
);

-- every tensor of the graph (inputs, parameters, states and operator outputs)
CREATE TABLE IF NOT EXISTS tensors (
    compilation_id  INTEGER,
    tensor_id       INTEGER,        -- the id of the node that produces it
    name            VARCHAR,                  -- the node's name
    role            VARCHAR,        -- input | parameter | op
    dtype           VARCHAR,                  -- element type
    shape           VARCHAR,                  -- the shape, e.g. [1, 8192, 4096]
    dims            VARCHAR,                  -- the index names of its dimensions
    elements        BIGINT,                   -- number of elements
    bytes           BIGINT,
    consumers       INTEGER,                  -- how many operators read it
    saved           BOOLEAN                   -- it is a saved output
);

-- every operator of the graph, with its DP piece
CREATE TABLE IF NOT EXISTS operators (
    compilation_id  INTEGER,
    op_id           INTEGER,        -- = tensor_id of its output
    op_name         VARCHAR,                  -- the node's name
    op_kind         VARCHAR,                  -- the operator kind (operator_kinds.kind)
    signature       VARCHAR,        -- einsum-like picture of its indices
    params          VARCHAR,        -- JSON
    shardable       VARCHAR,        -- requestable indices in declared order, name=extent
    aggregation     VARCHAR,        -- the operator's ⊕
    tree_id         INTEGER         -- the DP piece (cut at multi-consumer tensors), numbered in optimization order
);

-- every input edge of every operator
CREATE TABLE IF NOT EXISTS edges (
    compilation_id  INTEGER,
    op_id           INTEGER,        -- consumer
    input_pos       INTEGER,
    tensor_id       INTEGER,
    producer_op     INTEGER,        -- NULL for graph inputs; for an assigned state, the operator of its value
    cut             BOOLEAN,        -- the edge leaves a multi-consumer tensor (or joins two DP pieces)
    carried         BOOLEAN DEFAULT false  -- reads a state: priced from producer_op's tiling in the step before
);

-- the block sets (tilings) the candidate specs make and read, interned per tensor
CREATE TABLE IF NOT EXISTS tilings (
    compilation_id  INTEGER,
    tiling_id       INTEGER,
    tensor_id       INTEGER,
    is_grid         BOOLEAN,        -- false for overlapping block sets (causal key prefixes)
    grid            VARCHAR,        -- per-dimension breakpoints, or the list of blocks
    counts          VARCHAR,        -- blocks per dimension, e.g. 1x8x1
    blocks          INTEGER                   -- how many blocks
);

-- every candidate join-agg spec of every operator, costed (Algorithm 1's input)
CREATE TABLE IF NOT EXISTS candidate_specs (
    compilation_id    INTEGER,
    op_id             INTEGER,
    spec_id           INTEGER,
    split             VARCHAR,      -- idx=n,... over every requestable index, declared order
    intervals         VARCHAR,      -- the interval lists requested, per split index
    output_tiling     INTEGER,
    join_cost         DOUBLE,       -- 0 under "calibrated" (its edges price every byte a spec reads)
    aggregation_cost  DOUBLE,       -- under "calibrated": combining the partials of a saved output
    compute_cost      DOUBLE,       -- 0 under the paper's model; kernel seconds under "calibrated"
    flops             DOUBLE,
    imbalance         DOUBLE,       -- max/min FLOPs over function specs, minus one
    balanced          BOOLEAN,                -- its function specs' FLOPs are within the balance rule
    memory_bytes      BIGINT,       -- largest per-device working set (input blocks + output block)
    resident_bytes    BIGINT,       -- largest per-device bytes of graph-input blocks (they stay loaded)
    eligible          BOOLEAN,      -- offered to the selectors (balance and memory rules)
    layout_cost       DOUBLE DEFAULT 0.0  -- moving pinned input/state layouts (constraints) to the blocks it reads, and its value into a pinned state's blocks
);

-- per candidate spec and input, the blocks it reads and what reading them may cost
CREATE TABLE IF NOT EXISTS spec_inputs (
    compilation_id    INTEGER,
    op_id             INTEGER,
    spec_id           INTEGER,
    input_pos         INTEGER,
    required_tiling   INTEGER,      -- in_k(J): the distinct blocks of input k the spec reads
    producer_op       INTEGER,      -- NULL for graph inputs (materialized as required: no repartition)
    op_tree           INTEGER,      -- the DP piece of the consumer
    producer_tree     INTEGER,      -- the DP piece of the producer
    repartition       DOUBLE,       -- cost charged if the producer's tiling differs (unless edge_prices has the pair)
    floor             DOUBLE DEFAULT 0.0, -- least price of any producer tiling (edge_prices; else 0): charged
                                          -- while the producer is planned later
    carried           BOOLEAN DEFAULT false  -- reads an assigned state: producer_op made its value in the step
                                             -- before (never inside the consumer's DP piece)
);

-- Prices of an edge per pair of tilings, for cost models that price the pair (calibrated: the
-- seconds of the exchange delivering the producer's blocks as the blocks the spec reads).  Empty
-- under paper and bytes, where an edge costs spec_inputs.repartition whenever the two differ.
CREATE TABLE IF NOT EXISTS edge_prices (
    compilation_id    INTEGER,
    op_id             INTEGER,      -- consumer
    input_pos         INTEGER,
    producer_tiling   INTEGER,      -- the producer's output tiling
    required_tiling   INTEGER,      -- in_k(J) of a consumer spec
    price             DOUBLE                  -- the price of the pair, in the cost model's unit
);

-- Algorithm 1's table: Opt(op, T), the least cost of the operator's sub-tree with output tiling T
CREATE TABLE IF NOT EXISTS dp_table (
    compilation_id  INTEGER,
    op_id           INTEGER,
    tiling_id       INTEGER,        -- an output tiling some spec of the op produces
    cost            DOUBLE,         -- Opt(op, tiling)
    spec_id         INTEGER         -- the cheapest spec inducing it
);

-- the spec the selector chose for each operator
CREATE TABLE IF NOT EXISTS chosen (
    compilation_id  INTEGER,
    op_id           INTEGER,
    spec_id         INTEGER,
    output_tiling   INTEGER
);

-- The layout each assigned state keeps on the devices between executions (one row per state):
-- 'as read' keeps the blocks its readers read (replicated where they read it whole, like DDP; split
-- like Megatron where they read blocks); 'sharded' keeps its value's output blocks, one copy, and
-- gathers what each reader reads during the step (like ZeRO-3/FSDP).  The value is written into the
-- kept blocks at the end of each execution.
CREATE TABLE IF NOT EXISTS state_layouts (
    compilation_id  INTEGER,
    state_id        INTEGER,        -- the state's node id (tensors.tensor_id)
    state           VARCHAR,                  -- the state's name
    value_op        INTEGER,        -- the operator whose output is the state's next value
    kept            VARCHAR,        -- as read | sharded
    placement       VARCHAR,        -- DTensor/JAX-style notation of the kept blocks ('-' where none fits)
    blocks          INTEGER,        -- kept blocks over all devices
    bytes_per_device BIGINT,        -- the largest bytes kept on one device
    bytes_total     BIGINT,         -- over all devices (the tensor's bytes times its copies)
    write_bytes     BIGINT          -- bytes moved between devices to write the next value into the blocks
);

-- The physical plan, written by the compiler's record pass (one row set per compilation).

-- where each function spec of each operator runs
CREATE TABLE IF NOT EXISTS placements (
    compilation_id  INTEGER,
    op_id           INTEGER,
    function_index  INTEGER,        -- the function spec's index in the operator's chosen spec
    device          INTEGER,
    output_block    VARCHAR,        -- the block of the output it computes
    flops           DOUBLE,
    stage           INTEGER,        -- the pipeline stage whose devices run the operator (NULL: no pipeline)
    micro_batch     INTEGER         -- the micro-batch the function spec computes (NULL: no pipeline, or no batch index)
);

-- every exchange program: an operator's inputs (program = the operator's name), a saved output
-- ('save:<name>') or an assigned state's write ('assign:<state>')
CREATE TABLE IF NOT EXISTS exchange_programs (
    compilation_id  INTEGER,
    program         VARCHAR,                  -- the operator's name, save:<output> or assign:<state>
    op_id           INTEGER,        -- the operator whose inputs it delivers (NULL for save: and assign:)
    atoms           INTEGER,                  -- how many atoms (cells of the producer's blocks) it moves or combines
    actions         INTEGER,                  -- how many actions its body has
    text            VARCHAR         -- the program in ExProg text
);

-- every action of every exchange program, at each site it fires from
CREATE TABLE IF NOT EXISTS exchange_actions (
    compilation_id  INTEGER,
    program         VARCHAR,                  -- the exchange program (exchange_programs.program)
    op_id           INTEGER,
    action          INTEGER,        -- its index in the program's body, in the order the lowering fires them
    source_device   INTEGER,                  -- where the action forms its aggregate and sends it from
    dest_devices    INTEGER[],      -- where it sends the aggregate (empty: it only forms it)
    atoms           VARCHAR,        -- the aggregate, e.g. t0.1+t0.2
    aggregated      BOOLEAN,        -- more than one atom: a ⊕ at the source
    bytes           BIGINT          -- the aggregate's bytes (sent once to each destination)
);

-- the task DAG in the order each device runs it
CREATE TABLE IF NOT EXISTS tasks (
    compilation_id  INTEGER,
    task_id         INTEGER,                  -- its position in the task DAG (the order each device runs its tasks in)
    kind            VARCHAR,        -- load | decompose | aggregate | copy | recompose | kernel | assign
    op_id           INTEGER,        -- the operator it serves (NULL: a load, or a save's or assignment's exchange)
    device          INTEGER,        -- where it runs (a copy: its destination)
    src_device      INTEGER,        -- copies: the source
    bytes           BIGINT,         -- of its outputs
    inputs          INTEGER[],      -- the tasks whose outputs it reads (loads aside)
    label           VARCHAR
);

-- bytes moved between devices per edge (producer tensor -> consumer) and device pair
CREATE TABLE IF NOT EXISTS edge_traffic (
    compilation_id  INTEGER,
    producer_tensor INTEGER,        -- tensors.tensor_id of what moves (an operator's output or a sharded state)
    producer_op     INTEGER,        -- the operator that made it (NULL for a state)
    consumer_op     INTEGER,        -- the operator reading it (NULL for a save or an assignment)
    program         VARCHAR,        -- the exchange program that moves it
    src_device      INTEGER,                  -- the device the bytes leave
    dst_device      INTEGER,                  -- the device they reach
    bytes           BIGINT
);

-- each device's peak memory, split at the peak as the memory report does (CompiledGraph.memory_by_category)
CREATE TABLE IF NOT EXISTS device_memory (
    compilation_id  INTEGER,
    device          INTEGER,
    peak_bytes      BIGINT,                   -- the device's peak
    resident_bytes  BIGINT,         -- loaded inputs and kept states
    parameters      BIGINT,                   -- bytes of parameters live at the peak
    optimizer_state BIGINT,                   -- bytes of optimizer state (moments, master weights, step) at the peak
    inputs          BIGINT,                   -- bytes of graph inputs at the peak
    activations_for_the_backward BIGINT,      -- bytes of forward tensors a gradient operator reads, at the peak
    gradients       BIGINT,                   -- bytes of gradients at the peak
    optimizer_update BIGINT,                  -- bytes of the optimizer update's temporaries at the peak
    other           BIGINT                    -- every other byte live at the peak
);

-- per task, its simulated or measured start and end (cg.simulate(..., record=True), cg.profile(record=True))
CREATE TABLE IF NOT EXISTS task_times (
    compilation_id  INTEGER,
    task_id         INTEGER,                  -- the task (tasks.task_id)
    op_id           INTEGER,
    device          INTEGER,
    kind            VARCHAR,                  -- the task's kind
    start           DOUBLE,         -- seconds from the start of the execution
    "end"           DOUBLE,                   -- seconds from the start of the execution
    seconds         DOUBLE,                   -- end - start
    source          VARCHAR         -- simulated:<topology> | measured:<devices>
);

-- the constraints a compilation was planned under (compileGraph(..., constraints=...))
CREATE TABLE IF NOT EXISTS constraints (
    compilation_id  INTEGER,
    target          VARCHAR,        -- the operator, graph input or state constrained
    target_id       INTEGER,        -- its node id (tensors.tensor_id; operators.op_id for an operator)
    kind            VARCHAR,        -- split: the counts of the indices named, the others left to the optimizer; layout: the blocks an input or state is held in
    value           VARCHAR         -- a split: idx=n,... in candidate_specs.split's notation; a layout: R, S(d) or dim=n,...
);
