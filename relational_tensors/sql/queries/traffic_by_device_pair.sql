-- Bytes the plan moves between each pair of devices in one execution, and by how many copies
-- (compilation $cid; the latest compilation from the command line; the traffic_by_device_pair macro).
SELECT * FROM traffic_by_device_pair($cid);
