-- The greedy selector: Algorithm 1 without the repartition sub-cost, so each
-- operator independently takes its cheapest eligible spec (join + aggregation + compute + layout).
-- Parameters: $cid.
INSERT INTO chosen (compilation_id, op_id, spec_id, output_tiling)
SELECT $cid, op_id,
       first(spec_id ORDER BY join_cost + aggregation_cost + compute_cost + layout_cost, spec_id),
       first(output_tiling ORDER BY join_cost + aggregation_cost + compute_cost + layout_cost, spec_id)
FROM candidate_specs
WHERE compilation_id = $cid AND eligible
GROUP BY op_id;
