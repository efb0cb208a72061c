"""SAAP's kernels: the probe (``probe.py``: de-rope, the bucket classifier and the GQA group sum of its
probabilities in three Triton launches) and the bucketed sparse decode over inverted lists
(``buckets.py``), each beside its torch reference."""
