"""torch.distributed integration: gradient reduction in fp32 (comm), FSDP2 with FP8 all-gather (fsdp), tensor and
sequence parallel on DTensor (tp)."""
