"""Small-GPT training for `dion3 compare`: model, data and the training loop."""
