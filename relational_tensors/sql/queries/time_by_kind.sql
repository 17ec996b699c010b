-- Seconds per operator kind and device from the recorded task times (cg.simulate(record=True),
-- cg.profile(record=True)), per source of the times.
SELECT source, op_kind, count(DISTINCT op_id) AS ops, sum(seconds) AS seconds,
       max(seconds) AS slowest_op_device
FROM op_times
GROUP BY ALL
ORDER BY source, seconds DESC;
