"""Mixed precision around FP8: precision policy, loss scaling, fp32 norms, attention and master weights."""
