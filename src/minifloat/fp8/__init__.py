"""FP8 training core: recipes, scaling state, scaled GEMMs, the linear layer's autograd, modules, telemetry."""
