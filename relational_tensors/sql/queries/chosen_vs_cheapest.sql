-- Per operator, the chosen spec's cost against its cheapest eligible alternative, given the tilings
-- the plan chose for the producers: how much an operator gives up locally for the plan as a whole
-- (compilation $cid; the chosen_vs_cheapest table macro).
SELECT * FROM chosen_vs_cheapest($cid);
