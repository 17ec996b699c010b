-- Algorithm 1 on a group of pieces with no edge between them (the same as solving them one after
-- another), in one statement: a recursive CTE keyed by (op, tiling) computes the waves in turn, each
-- wave's operators (their in-piece producers in earlier waves, read from the rows the recursion has
-- kept: recurring.dp) for every eligible spec J,
--   B(J) = join(J) + aggregation(J) + compute(J) + layout(J) + sum over inputs k of
--            0                                   graph input (materialized as J needs)
--            price(F, in_k(J))                   producer fixed by an earlier piece with tiling F
--            min over T of Opt(P, T) + price(T, in_k(J))   producer in this piece
--            floor(in_k(J))                      producer in a later piece (it pays the rest), or
--                                                a state's value made in this piece (refine prices it)
-- and Opt(op, T) = min over specs J with out(J) = T of B(J), ties to the lowest spec id.
-- price(T, R) is the edge's row of edge_prices for the pair when there is one (pairwise cost
-- models), else 0 when T = R and spec_inputs.repartition otherwise (the paper's rule); floor(R)
-- is the least price of R over the producer's tilings under a pairwise model, else 0.
-- $memory_price prices the bytes of graph inputs a spec keeps resident per device (0 unless a
-- memory limit must be met: a Lagrangian relaxation of the whole plan's memory).
-- Parameters: $cid, $ops with $waves (each operator's wave in its piece), $memory_price.  Returns
-- the rows it inserts (the traceback reads them).
INSERT INTO dp_table (compilation_id, op_id, tiling_id, cost, spec_id)
WITH RECURSIVE
waves AS (SELECT unnest($ops::INTEGER[]) AS op_id, unnest($waves::INTEGER[]) AS h),
dp(op_id, tiling_id, cost, spec_id, h) USING KEY (op_id, tiling_id) AS (
    SELECT -1, -1, 0.0::DOUBLE, -1, -1  -- a seed row before wave 0 (dropped at the end)
    UNION
    (
    WITH wave AS (SELECT op_id, h FROM waves WHERE h = (SELECT max(h) + 1 FROM dp)),
    edges AS (
        SELECT si.op_id, si.spec_id, si.input_pos, si.producer_op, si.required_tiling, si.repartition, si.floor,
               f.output_tiling AS fixed_tiling,
               (si.producer_op IS NOT NULL AND f.output_tiling IS NULL AND si.producer_tree = si.op_tree
                AND NOT si.carried) AS in_piece
        FROM spec_inputs si
        JOIN wave USING (op_id)
        LEFT JOIN chosen f ON f.compilation_id = $cid AND f.op_id = si.producer_op
        WHERE si.compilation_id = $cid AND si.producer_op IS NOT NULL
    ),
    starts AS (
        SELECT op_id, spec_id, input_pos, required_tiling, repartition, fixed_tiling AS tiling_id, 0.0 AS opt
        FROM edges
        WHERE fixed_tiling IS NOT NULL
        UNION ALL
        SELECT e.op_id, e.spec_id, e.input_pos, e.required_tiling, e.repartition, d.tiling_id, d.cost
        FROM edges e
        JOIN recurring.dp d ON d.op_id = e.producer_op
        WHERE e.in_piece
    ),
    edge_costs AS (
        SELECT s.op_id, s.spec_id, s.input_pos,
               min(s.opt + coalesce(p.price, CASE WHEN s.tiling_id = s.required_tiling THEN 0.0 ELSE s.repartition END))
                   AS cost
        FROM starts s
        LEFT JOIN edge_prices p
            ON p.compilation_id = $cid AND p.op_id = s.op_id AND p.input_pos = s.input_pos
           AND p.producer_tiling = s.tiling_id AND p.required_tiling = s.required_tiling
        GROUP BY s.op_id, s.spec_id, s.input_pos
    ),
    input_costs AS (
        SELECT e.op_id, e.spec_id,
               list_sum(list(CASE WHEN e.fixed_tiling IS NOT NULL OR e.in_piece THEN coalesce(c.cost, 'inf'::DOUBLE)
                                  ELSE e.floor END ORDER BY e.input_pos)) AS cost  -- in input order: the same bits every run
        FROM edges e
        LEFT JOIN edge_costs c USING (op_id, spec_id, input_pos)
        GROUP BY e.op_id, e.spec_id
    ),
    costed AS (
        SELECT s.op_id, s.spec_id, s.output_tiling, w.h,
               s.join_cost + s.aggregation_cost + s.compute_cost + s.layout_cost + $memory_price * s.resident_bytes
               + coalesce(ic.cost, 0.0) AS cost
        FROM candidate_specs s
        JOIN wave w USING (op_id)
        LEFT JOIN input_costs ic USING (op_id, spec_id)
        WHERE s.compilation_id = $cid AND s.eligible
    )
    SELECT op_id, output_tiling, min(cost), first(spec_id ORDER BY cost, spec_id), max(h)
    FROM costed
    GROUP BY op_id, output_tiling
    )
)
SELECT $cid, op_id, tiling_id, cost, spec_id FROM dp WHERE op_id >= 0
RETURNING op_id, tiling_id, cost, spec_id;
