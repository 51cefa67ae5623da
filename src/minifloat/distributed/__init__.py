"""torch.distributed integration: gradient reduction in fp32, amax agreement across ranks."""
