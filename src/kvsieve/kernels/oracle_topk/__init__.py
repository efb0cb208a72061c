"""oracle-topk's kernels: every score in one pass over K, then the exact top keys (``topk.py``, with its
torch reference)."""
