"""The planner: the per-GPU memory estimate, the step time, the per-stage split and the layout search
over a resolved recipe (:mod:`muse_stack.resolve`, which holds the layout rules it reports)."""
