"""vAttention's kernels: the budget statistics and the residual setup in float64 (``budget_triton.py``);
their torch twin is the method's ``budget`` (``methods/vattention.py``)."""
