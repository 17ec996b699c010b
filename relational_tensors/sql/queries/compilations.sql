-- Every compilation in the catalog side by side (useful on a persisted catalog file); status says
-- whether it made a plan (ok), was refused (no plan fits the memory) or failed, and error why.
SELECT c.compilation_id, c.label, c.devices, c.selector, c.seed, c.cost_model, c.status, c.plan_cost,
       round(c.planning_seconds, 3) AS planning_seconds,
       count(p.op_id) FILTER (WHERE p.repartition_cost > 0) AS repartitioning_ops, c.error
FROM compilations c
LEFT JOIN plan p USING (compilation_id)
GROUP BY ALL
ORDER BY c.compilation_id;
