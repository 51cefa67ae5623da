"""Safety nets: step guards, stability tricks, the FP8/BF16 shadow check, pre-flight checks and audit."""
