"""The planner: layout rules, the per-stage split, and the per-GPU memory estimate."""
