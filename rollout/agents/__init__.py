"""Multi-turn agent rollouts: a loop plays a trajectory of model turns and tool results in one Sample, token in,
token out (base.py: the seam; trajectory.py: the bookkeeping; glm.py: the default loop; runtime.py: per task)."""
