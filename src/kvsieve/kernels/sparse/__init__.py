"""Sparse attention over index lists: the weighted sparse decode contract (``weighted.py``) that every
selection method lowers to, its torch reference, and the kernels that implement it."""
