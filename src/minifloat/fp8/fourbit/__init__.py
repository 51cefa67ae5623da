"""The 4-bit training path (NVFP4Scaling, MXScaling(format="e2m1")): how a layer's tensors are cast to 4 bits
(`cast`: NVFP4 with the random Hadamard transform and stochastic rounding) and the autograd Function that runs its
three GEMMs on them (`linear`). The FP8 path is minifloat.fp8.caster and minifloat.fp8.autograd; both share the
layer's `LayerCaster` (amax records, telemetry, scaling state) and `scaled_mm`. docs/fp4.md has the numerics."""
