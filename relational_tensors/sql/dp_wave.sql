-- One wave of Algorithm 1: for every operator of the wave (their in-piece producers
-- are already in dp_table; the wave may span several pieces with no edge between
-- them, which is the same as solving them one after another) and every eligible spec J,
--   B(J) = join(J) + aggregation(J) + compute(J) + sum over inputs k of
--            0                                   graph input (materialized as J needs)
--            [fixed tiling != in_k(J)]·|input|  producer fixed by an earlier piece
--            min(Opt(P, in_k(J)), min_T Opt(P, T) + |input|)   producer in this piece
--            0                                   producer in a later piece (it pays)
-- and Opt(op, T) = min over specs J with out(J) = T of B(J), ties to the lowest spec id.
-- $memory_price prices the bytes of graph inputs a spec keeps resident per device (0 unless a
-- memory limit must be met: a Lagrangian relaxation of the whole plan's memory).
-- Parameters: $cid, $ops, $memory_price.
INSERT INTO dp_table (compilation_id, op_id, tiling_id, cost, spec_id)
WITH wave AS (SELECT unnest($ops::INTEGER[]) AS op_id),
best AS (
    SELECT op_id, min(cost) AS cost FROM dp_table WHERE compilation_id = $cid GROUP BY op_id
),
input_costs AS (
    SELECT si.op_id, si.spec_id, sum(
        CASE
            WHEN si.producer_op IS NULL THEN 0.0
            WHEN f.output_tiling IS NOT NULL THEN
                CASE WHEN f.output_tiling = si.required_tiling THEN 0.0 ELSE si.repartition END
            WHEN si.producer_tree = si.op_tree THEN
                least(coalesce(d.cost, 'inf'::DOUBLE), b.cost + si.repartition)
            ELSE 0.0
        END) AS cost
    FROM spec_inputs si
    JOIN wave USING (op_id)
    LEFT JOIN chosen f ON f.compilation_id = $cid AND f.op_id = si.producer_op
    LEFT JOIN dp_table d
        ON d.compilation_id = $cid AND d.op_id = si.producer_op AND d.tiling_id = si.required_tiling
    LEFT JOIN best b ON b.op_id = si.producer_op
    WHERE si.compilation_id = $cid
    GROUP BY si.op_id, si.spec_id
),
costed AS (
    SELECT s.op_id, s.spec_id, s.output_tiling,
           s.join_cost + s.aggregation_cost + s.compute_cost + $memory_price * s.resident_bytes + coalesce(ic.cost, 0.0) AS cost
    FROM candidate_specs s
    JOIN wave USING (op_id)
    LEFT JOIN input_costs ic USING (op_id, spec_id)
    WHERE s.compilation_id = $cid AND s.eligible
)
SELECT $cid, op_id, output_tiling, min(cost), first(spec_id ORDER BY cost, spec_id)
FROM costed
GROUP BY op_id, output_tiling;
