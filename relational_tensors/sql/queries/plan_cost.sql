-- The cost of the chosen plan per sub-cost.
SELECT sum(repartition_cost) AS repartition, sum(join_cost) AS "join",
       sum(aggregation_cost) AS aggregation, sum(compute_cost) AS compute, sum(layout_cost) AS layout, sum(total_cost) AS total
FROM plan;
