"""This machine, as a run meets it: whether it can run a recipe's engine and device, the peak
FLOP/s an MFU figure is divided by, and what a run held on its GPU. The GPU models' stated facts
are in :mod:`muse_stack.machine.hardware`."""
