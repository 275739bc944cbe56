"""The planner: the partition search (RoundPipe stages under memory limits; the simulator's
fastest candidate, found best first under a proven lower bound, ``bound``) and the
weight-bound baselines' partitions. It sits above ``passes``
and ``sim``: it reads costs and calls the simulator's models, never the other way round."""
