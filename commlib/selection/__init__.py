"""``algorithm="auto"``: which schedule a call runs, from its size, the world size, the hosts
(:mod:`.auto`, :mod:`.across_hosts`) or a fitted cost model (:mod:`.cost_model`,
:mod:`.formulas`)."""
