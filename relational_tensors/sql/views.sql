-- Contract views.  Persisted files hold them over every finished compilation (status 'ok', with
-- compilation_id): a compilation refused for memory, failed or still running is no plan.  A compiled
-- graph's cg.sql() sees them narrowed to itself, whatever its status (Catalog.narrow: TEMP views).
-- {shown} is replaced by the compilations shown: a query of their ids, or one id.

-- An edge's repartition cost: 0 from a graph input, else the price of the pair (producer's
-- tiling, tiling read): its edge_prices row if it has one, else the paper's rule.
CREATE OR REPLACE {temp} VIEW plan_inputs AS
SELECT si.compilation_id, c.op_id, si.input_pos, si.required_tiling, si.producer_op,
       pc.output_tiling AS producer_tiling,
       CASE WHEN si.producer_op IS NULL THEN 0.0
            ELSE coalesce(ep.price, CASE WHEN pc.output_tiling = si.required_tiling THEN 0.0 ELSE si.repartition END)
       END AS repartition_cost
FROM chosen c
JOIN spec_inputs si ON si.compilation_id = c.compilation_id AND si.op_id = c.op_id AND si.spec_id = c.spec_id
LEFT JOIN chosen pc ON pc.compilation_id = si.compilation_id AND pc.op_id = si.producer_op
LEFT JOIN edge_prices ep ON ep.compilation_id = si.compilation_id AND ep.op_id = si.op_id
      AND ep.input_pos = si.input_pos AND ep.producer_tiling = pc.output_tiling AND ep.required_tiling = si.required_tiling
WHERE si.compilation_id IN ({shown});

CREATE OR REPLACE {temp} VIEW plan AS
SELECT o.compilation_id, o.op_id, o.op_name, o.op_kind, s.split, s.spec_id,
       t.counts AS output_tiling, t.grid AS output_grid,
       COALESCE(r.repartition_cost, 0.0) AS repartition_cost,
       s.join_cost, s.aggregation_cost, s.compute_cost, s.layout_cost,
       COALESCE(r.repartition_cost, 0.0) + s.join_cost + s.aggregation_cost + s.compute_cost + s.layout_cost
           AS total_cost,
       COALESCE(r.repartitioned_inputs, '') AS repartitioned_inputs,
       s.flops, s.imbalance, s.memory_bytes
FROM chosen c
JOIN operators o ON o.compilation_id = c.compilation_id AND o.op_id = c.op_id
JOIN candidate_specs s ON s.compilation_id = c.compilation_id AND s.op_id = c.op_id AND s.spec_id = c.spec_id
JOIN tilings t ON t.compilation_id = c.compilation_id AND t.tiling_id = c.output_tiling
LEFT JOIN (
    SELECT pi.compilation_id, pi.op_id, SUM(pi.repartition_cost) AS repartition_cost,
           string_agg(CASE WHEN pi.repartition_cost > 0 THEN tn.name END, ', ' ORDER BY pi.input_pos)
               AS repartitioned_inputs
    FROM plan_inputs pi
    JOIN edges e ON e.compilation_id = pi.compilation_id AND e.op_id = pi.op_id AND e.input_pos = pi.input_pos
    JOIN tensors tn ON tn.compilation_id = e.compilation_id AND tn.tensor_id = e.tensor_id
    GROUP BY ALL
) r ON r.compilation_id = c.compilation_id AND r.op_id = c.op_id
WHERE c.compilation_id IN ({shown})
ORDER BY o.compilation_id, o.op_id;

-- Every candidate, with the repartition it would cost given the tilings the plan
-- chose for its producers (NULL before a plan exists).
CREATE OR REPLACE {temp} VIEW specs AS
SELECT o.compilation_id, o.op_id, o.op_name, o.op_kind, s.spec_id, s.split, s.intervals,
       t.counts AS output_tiling, rc.repartition_cost,
       s.join_cost, s.aggregation_cost, s.compute_cost, s.layout_cost,
       COALESCE(rc.repartition_cost, 0.0) + s.join_cost + s.aggregation_cost + s.compute_cost + s.layout_cost
           AS total_cost,
       s.flops, s.imbalance, s.balanced, s.memory_bytes, s.eligible,
       (c.spec_id IS NOT NULL) AS chosen
FROM candidate_specs s
JOIN operators o ON o.compilation_id = s.compilation_id AND o.op_id = s.op_id
JOIN tilings t ON t.compilation_id = s.compilation_id AND t.tiling_id = s.output_tiling
LEFT JOIN chosen c ON c.compilation_id = s.compilation_id AND c.op_id = s.op_id AND c.spec_id = s.spec_id
LEFT JOIN (
    SELECT si.compilation_id, si.op_id, si.spec_id,
           SUM(CASE WHEN si.producer_op IS NULL THEN 0.0
                    WHEN pc.output_tiling IS NULL THEN NULL
                    ELSE coalesce(ep.price, CASE WHEN pc.output_tiling = si.required_tiling THEN 0.0
                                                 ELSE si.repartition END) END) AS repartition_cost
    FROM spec_inputs si
    LEFT JOIN chosen pc ON pc.compilation_id = si.compilation_id AND pc.op_id = si.producer_op
    LEFT JOIN edge_prices ep ON ep.compilation_id = si.compilation_id AND ep.op_id = si.op_id
          AND ep.input_pos = si.input_pos AND ep.producer_tiling = pc.output_tiling
          AND ep.required_tiling = si.required_tiling
    GROUP BY ALL
) rc ON rc.compilation_id = s.compilation_id AND rc.op_id = s.op_id AND rc.spec_id = s.spec_id
WHERE s.compilation_id IN ({shown})
ORDER BY o.compilation_id, o.op_id, s.spec_id;

-- Seconds per operator and device, from the recorded task times (cg.simulate(..., record=True) and
-- cg.profile(record=True)), per source of the times.
CREATE OR REPLACE {temp} VIEW op_times AS
SELECT tt.compilation_id, tt.source, tt.op_id, o.op_name, o.op_kind, tt.device,
       count(*) AS tasks, sum(tt.seconds) AS seconds, min(tt.start) AS first_start, max(tt."end") AS last_end
FROM task_times tt
LEFT JOIN operators o ON o.compilation_id = tt.compilation_id AND o.op_id = tt.op_id
WHERE tt.compilation_id IN ({shown})
GROUP BY ALL
ORDER BY tt.compilation_id, tt.source, tt.op_id, tt.device;
