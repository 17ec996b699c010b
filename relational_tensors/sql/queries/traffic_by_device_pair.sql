-- Bytes the plan moves between each pair of devices in one execution, and by how many copies
-- (compilation $cid; the latest compilation from the command line).
SELECT src_device, dst_device, sum(bytes)::BIGINT AS bytes, count(*) AS edges
FROM edge_traffic
WHERE compilation_id = $cid
GROUP BY ALL
ORDER BY bytes DESC, src_device, dst_device;
