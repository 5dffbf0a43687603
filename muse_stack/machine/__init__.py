"""This machine, as a run meets it: the peak FLOP/s an MFU figure is divided by, and what a run
held on its GPU (whether it can run a recipe's engine and device is
:mod:`muse_stack.run.availability`). Every machine muse-stack plans for and launches on is one row
of the machine table (``machines.yaml``, read by :mod:`muse_stack.machine.table`);
:mod:`muse_stack.machine.hardware` gives its GPUs' stated facts."""
