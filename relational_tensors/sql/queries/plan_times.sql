-- Every finished compilation's simulated time (ms, at its first cg.simulate(); NULL before one) and its
-- peak memory (GiB, the busiest device), one column per topology: hand plans (constraints) beside the
-- optimizer's, each planned for that topology. Rows by label, in the order they were first compiled.
WITH runs AS (
    SELECT label, topology, predicted_seconds * 1e3 AS ms, peak_bytes / 2 ^ 30 AS gib, compilation_id
    FROM compilations
    WHERE status = 'ok'
)
SELECT label,
       round(first(ms) FILTER (WHERE topology = 'hgx-h200'), 2) AS "hgx-h200 ms",
       round(first(ms) FILTER (WHERE topology = 'dgx-a100'), 2) AS "dgx-a100 ms",
       round(first(gib) FILTER (WHERE topology = 'hgx-h200'), 2) AS "hgx-h200 GiB",
       round(first(gib) FILTER (WHERE topology = 'dgx-a100'), 2) AS "dgx-a100 GiB",
       string_agg(DISTINCT topology, ', ' ORDER BY topology)
           FILTER (WHERE topology NOT IN ('hgx-h200', 'dgx-a100')) AS other_topologies
FROM runs
GROUP BY label
ORDER BY min(compilation_id);
