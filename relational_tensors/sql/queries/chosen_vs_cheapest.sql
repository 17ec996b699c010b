-- Per operator, the chosen spec's cost against its cheapest eligible alternative, given the tilings
-- the plan chose for the producers: how much an operator gives up locally for the plan as a whole.
WITH best AS (
    SELECT op_id, min(total_cost) AS cheapest, arg_min(split, total_cost) AS cheapest_split
    FROM specs
    WHERE eligible
    GROUP BY op_id
)
SELECT s.op_name, s.op_kind, s.split AS chosen_split, s.total_cost AS chosen_cost, b.cheapest_split,
       b.cheapest AS cheapest_cost, s.total_cost - b.cheapest AS given_up
FROM specs s
JOIN best b USING (op_id)
WHERE s.chosen
ORDER BY given_up DESC, s.op_id;
