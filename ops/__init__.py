"""Kernels used by the model: attention, RMSNorm, rotary embeddings, losses. Depends on torch only."""
