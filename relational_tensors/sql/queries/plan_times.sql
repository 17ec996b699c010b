-- Every finished compilation's simulated time (ms, at its first cg.simulate(); NULL before one) and its
-- peak memory (GiB, the busiest device), a column for each of hgx-h200 and dgx-a100: hand plans
-- (constraints) beside the optimizer's, each planned for that topology. Rows by label, in the order they were first compiled.
WITH runs AS (
    SELECT label, topology, predicted_seconds * 1e3 AS ms, peak_bytes / 2 ^ 30 AS gib, compilation_id
    FROM compilations
    WHERE status = 'ok'
)
SELECT label,
       round(first(ms) FILTER (WHERE topology = 'hgx-h200'), 2) AS "hgx-h200 ms",
       round(first(ms) FILTER (WHERE topology = 'dgx-a100'), 2) AS "dgx-a100 ms",
       round(first(gib) FILTER (WHERE topology = 'hgx-h200'), 2) AS "hgx-h200 GiB",
       round(first(gib) FILTER (WHERE topology = 'dgx-a100'), 2) AS "dgx-a100 GiB"
FROM runs
GROUP BY label
ORDER BY min(compilation_id);
