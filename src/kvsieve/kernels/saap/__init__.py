"""SAAP's probe on the device (``probe.py``): de-rope, the bucket classifier and the GQA group sum of its
probabilities in three Triton launches, beside their torch reference. The bucket attention itself is
the shared ``kernels/sparse/buckets.py``."""
