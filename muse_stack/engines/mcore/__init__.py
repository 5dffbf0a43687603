"""megatron-core building blocks of the Muse Spark GPU engine: config, layer spec, model, weight names."""
