-- The output tiling of a piece's root: Opt(root, T) plus the repartitions that
-- consumers fixed by earlier pieces would pay if T differs from what they read.
-- Parameters: $cid, $root.
WITH fixed_readers AS (
    SELECT si.required_tiling, si.repartition
    FROM spec_inputs si
    JOIN chosen c ON c.compilation_id = si.compilation_id AND c.op_id = si.op_id AND c.spec_id = si.spec_id
    WHERE si.compilation_id = $cid AND si.producer_op = $root
)
SELECT d.tiling_id, d.spec_id,
       d.cost + coalesce((SELECT sum(CASE WHEN r.required_tiling = d.tiling_id THEN 0.0 ELSE r.repartition END)
                          FROM fixed_readers r), 0.0) AS total
FROM dp_table d
WHERE d.compilation_id = $cid AND d.op_id = $root
ORDER BY total, d.tiling_id
LIMIT 1;
