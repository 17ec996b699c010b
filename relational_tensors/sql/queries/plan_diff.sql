-- Two compilations of one graph side by side ($a and $b, compilation ids): per operator name, the
-- split, output tiling and cost each chose, and whether they differ.
WITH side AS (
    SELECT c.compilation_id, o.op_id, o.op_name, o.op_kind, s.split, t.counts AS output_tiling,
           s.join_cost + s.aggregation_cost + s.compute_cost + s.layout_cost AS local_cost
    FROM chosen c
    JOIN operators o USING (compilation_id, op_id)
    JOIN candidate_specs s ON s.compilation_id = c.compilation_id AND s.op_id = c.op_id AND s.spec_id = c.spec_id
    JOIN tilings t ON t.compilation_id = c.compilation_id AND t.tiling_id = c.output_tiling
)
SELECT coalesce(a.op_name, b.op_name) AS op_name, coalesce(a.op_kind, b.op_kind) AS op_kind,
       a.split AS split_a, b.split AS split_b, a.output_tiling AS tiling_a, b.output_tiling AS tiling_b,
       a.local_cost AS cost_a, b.local_cost AS cost_b,
       (a.split IS DISTINCT FROM b.split OR a.output_tiling IS DISTINCT FROM b.output_tiling) AS changed
FROM (SELECT * FROM side WHERE compilation_id = $a) a
FULL JOIN (SELECT * FROM side WHERE compilation_id = $b) b USING (op_name)
ORDER BY coalesce(a.op_id, b.op_id);
