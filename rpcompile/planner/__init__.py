"""The planner: the partition search (RoundPipe stages under memory limits, candidates ranked
by the dispatch model) and the weight-bound baselines' partitions. It sits above ``passes``
and ``sim``: it reads costs and calls the simulator's models, never the other way round."""
