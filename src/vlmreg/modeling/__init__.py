"""What the trainer runs of the model besides transformers' own forward: block-diagonal attention for packed rows
(`attention`), per-token logprobs and entropy without full-vocabulary logits (`logprobs`), and selective
recomputation under a memory budget (`recompute`)."""
