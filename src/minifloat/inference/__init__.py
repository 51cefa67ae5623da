"""FP8 inference: prepare_inference, save/load of FP8 weights, export to Hugging Face layouts, generation.

This layer sits above training (it rebuilds and generates with the reference Llama of minifloat.training.model and
reads run folders) and below the CLI.
"""
