"""A finished run in others' formats, and published records read back: ``muse-stack export`` (the
run's checkpoint in transformers' layout, :mod:`muse_stack.publish.hf`) and ``muse-stack record``
(OpenRecipes records: a run exported as one, a published one imported as a recipe)."""
