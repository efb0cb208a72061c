"""MagicPIG's kernels: SimHash codes kept as the cache grows, the collision test and the retrieved keys'
cosines (``lsh_triton.py``); its torch reference is the method's own path (``methods/magicpig.py``)."""
