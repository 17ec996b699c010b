-- Two compilations of one graph side by side ($a and $b, compilation ids): per operator name, the
-- split, output tiling and cost each chose, and whether they differ (the plan_diff table macro).
SELECT * FROM plan_diff($a, $b);
