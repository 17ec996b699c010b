-- Which operators repartition an input, which input, and what it costs.
SELECT p.op_name, p.op_kind, p.split, p.repartitioned_inputs, p.repartition_cost
FROM plan p
WHERE p.repartition_cost > 0
ORDER BY p.repartition_cost DESC, p.op_id;
