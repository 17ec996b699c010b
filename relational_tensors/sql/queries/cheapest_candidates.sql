-- The ten cheapest eligible candidates of one kind of operator ($kind), given the
-- tilings the plan chose for their producers.
SELECT op_name, split, output_tiling, repartition_cost, join_cost, aggregation_cost, total_cost, chosen
FROM specs
WHERE op_kind = $kind AND eligible
ORDER BY total_cost, op_name, spec_id
LIMIT 10;
