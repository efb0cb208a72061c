"""oracle-topp's kernels: the top-p set by a radix select on the probabilities' bits (``topp_triton.py``);
its torch reference is ``methods/shared/selection.top_p``."""
