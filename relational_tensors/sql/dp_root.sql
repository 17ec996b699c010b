-- The output tiling of each piece's root: Opt(root, T) plus what the consumers fixed by
-- earlier pieces pay to read T (their edge's price for the pair, less the floor those
-- consumers already charged themselves, see dp_group.sql); the cheapest per root, ties to
-- the lowest tiling id.
-- Parameters: $cid, $roots.
WITH roots AS (SELECT unnest($roots::INTEGER[]) AS op_id),
fixed_readers AS (
    SELECT si.producer_op AS op_id, si.op_id AS reader, si.input_pos, si.required_tiling, si.repartition, si.floor
    FROM spec_inputs si
    JOIN roots r ON r.op_id = si.producer_op
    JOIN chosen c ON c.compilation_id = si.compilation_id AND c.op_id = si.op_id AND c.spec_id = si.spec_id
    WHERE si.compilation_id = $cid
),
totals AS (
    SELECT d.op_id, d.tiling_id, d.spec_id,
           d.cost + coalesce(list_sum(list(coalesce(p.price - f.floor,
                                                    CASE WHEN f.required_tiling = d.tiling_id THEN 0.0
                                                         ELSE f.repartition END)
                                           ORDER BY f.reader, f.input_pos)), 0.0) AS total  -- in a fixed order
    FROM dp_table d
    JOIN roots USING (op_id)
    LEFT JOIN fixed_readers f ON f.op_id = d.op_id
    LEFT JOIN edge_prices p
        ON p.compilation_id = $cid AND p.op_id = f.reader AND p.input_pos = f.input_pos
       AND p.producer_tiling = d.tiling_id AND p.required_tiling = f.required_tiling
    WHERE d.compilation_id = $cid
    GROUP BY d.op_id, d.tiling_id, d.spec_id, d.cost
)
SELECT op_id, first(tiling_id ORDER BY total, tiling_id), first(spec_id ORDER BY total, tiling_id), min(total)
FROM totals
GROUP BY op_id;
