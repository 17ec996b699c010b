-- Table macros for the research questions, over any compilations of the catalog (the named queries
-- of sql/queries call them with their parameters): SELECT * FROM plan_diff(1, 2), and so on.

-- Two compilations of one graph side by side: per operator name, the split, output tiling and local
-- cost (join + aggregation + compute + layout) each chose, and whether they differ.
CREATE OR REPLACE {temp} MACRO plan_diff(compilation_a, compilation_b) AS TABLE
WITH side AS (
    SELECT c.compilation_id, o.op_id, o.op_name, o.op_kind, s.split, t.counts AS output_tiling,
           s.join_cost + s.aggregation_cost + s.compute_cost + s.layout_cost AS local_cost
    FROM chosen c
    JOIN operators o USING (compilation_id, op_id)
    JOIN candidate_specs s ON s.compilation_id = c.compilation_id AND s.op_id = c.op_id AND s.spec_id = c.spec_id
    JOIN tilings t ON t.compilation_id = c.compilation_id AND t.tiling_id = c.output_tiling
    WHERE c.compilation_id IN (compilation_a, compilation_b)
)
SELECT coalesce(l.op_name, r.op_name) AS op_name, coalesce(l.op_kind, r.op_kind) AS op_kind,
       l.split AS split_a, r.split AS split_b, l.output_tiling AS tiling_a, r.output_tiling AS tiling_b,
       l.local_cost AS cost_a, r.local_cost AS cost_b,
       (l.split IS DISTINCT FROM r.split OR l.output_tiling IS DISTINCT FROM r.output_tiling) AS changed
FROM (SELECT * FROM side WHERE compilation_id = compilation_a) l
FULL JOIN (SELECT * FROM side WHERE compilation_id = compilation_b) r USING (op_name)
ORDER BY coalesce(l.op_id, r.op_id);

-- Per operator, the chosen spec's cost against its cheapest eligible alternative, given the tilings
-- the plan chose for the producers: how much an operator gives up locally for the plan as a whole.
CREATE OR REPLACE {temp} MACRO chosen_vs_cheapest(compilation) AS TABLE
WITH shown AS (SELECT * FROM specs WHERE compilation_id = compilation),
best AS (
    SELECT op_id, min(total_cost) AS cheapest, arg_min(split, total_cost) AS cheapest_split
    FROM shown
    WHERE eligible
    GROUP BY op_id
)
SELECT s.op_name, s.op_kind, s.split AS chosen_split, s.total_cost AS chosen_cost, b.cheapest_split,
       b.cheapest AS cheapest_cost, s.total_cost - b.cheapest AS given_up
FROM shown s
JOIN best b USING (op_id)
WHERE s.chosen
ORDER BY given_up DESC, s.op_id;

-- Bytes a compilation's plan moves between each pair of devices in one execution, and by how many copies.
CREATE OR REPLACE {temp} MACRO traffic_by_device_pair(compilation) AS TABLE
SELECT src_device, dst_device, sum(bytes)::BIGINT AS bytes, count(*) AS edges
FROM edge_traffic
WHERE compilation_id = compilation
GROUP BY ALL
ORDER BY bytes DESC, src_device, dst_device;

-- Seconds per operator kind from a compilation's recorded task times, per source of the times.
CREATE OR REPLACE {temp} MACRO time_by_kind(compilation) AS TABLE
SELECT source, op_kind, count(DISTINCT op_id) AS ops, sum(seconds) AS seconds,
       max(seconds) AS slowest_op_device
FROM op_times
WHERE compilation_id = compilation
GROUP BY ALL
ORDER BY source, seconds DESC;
