-- Seconds per operator kind and device from the recorded task times (cg.simulate(record=True),
-- cg.profile(record=True)), per source of the times (compilation $cid; the time_by_kind macro).
SELECT * FROM time_by_kind($cid);
