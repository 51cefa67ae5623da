"""The reference Llama, byte-level data, checkpoints, the training loop and preset comparison."""
