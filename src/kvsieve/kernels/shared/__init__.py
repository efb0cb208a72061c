"""The execution contracts every method may lower to, each torch reference beside its Triton kernel: the
weighted sparse decode (``weighted.py``, ``weighted_triton.py``), the block-sparse causal prefill
(``block_sparse*.py``), the dense split-KV decode (``dense.py``), the selection helpers (the exact top-k
rows select, the uniform sample without replacement) and the Triton helpers they share
(``triton_utils.py``). A method's own kernels live in ``kernels/<method>/`` and build on these."""
