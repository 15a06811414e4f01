"""Prompt tokens counted as the replica counts them: each model's tokenizer and chat template."""
