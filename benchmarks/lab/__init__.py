"""The lab: what the benchmark scripts and tests share and the product never imports.

``benchio`` (a script's command line, the engine it builds, GPU timing, its end), ``engine`` (the
megatron engine on given weights, one micro-batch's loss and logits), ``messages`` (the collectives
of one step, which ``scripts/comm.py`` times) and ``verify/`` (the parity harnesses). The lab
imports the product; the product never imports the lab (``tests/unit/test_product_boundary.py``).

``benchmarks/`` is the folder to put on the path (the tests' ``pythonpath`` in ``pyproject.toml``;
each script under ``benchmarks/scripts/`` adds it itself)::

    PYTHONPATH=.:benchmarks python -m lab.verify.parity --train-steps 3
"""
