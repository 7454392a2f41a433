"""The Ray driver: placement, the RL loops, the sample buffer, weight sync."""
