"""Kernels used by the model: attention (per block, and ring attention over a process group for
context parallelism), RMSNorm, rotary embeddings, losses. Depends on torch only."""
