"""Number formats and the one rounding path: formats, quantize, compiled kernels."""
