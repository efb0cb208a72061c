"""Sketch&Walk's decode selection on the device: ``decode.py`` fuses the per-token sketch update, the
token's (and a completed block's) row of Ã, the walk step and the block selection into four Triton
launches around one ``torch.topk``; its torch reference is the method's own path
(:mod:`kvsieve.methods.sketchwalk`, ``backend="reference"``)."""
