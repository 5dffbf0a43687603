"""The validate-and-resolve step: a recipe turned once into what it implies on its machine
(:mod:`muse_stack.resolve.recipe`), with megatron-core's layout rules (:mod:`muse_stack.resolve.rules`).
It sits above the recipe, the data, the engines and the machine whose checks it runs, and below the
planner and the runner that read what it resolved."""
