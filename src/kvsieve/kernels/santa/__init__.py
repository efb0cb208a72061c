"""S²ANTA (stochastic sparse attention): tile statistics and systematic sampling of V rows.

``reference.py`` and ``systematic.py`` hold the float64 torch references; ``decode.py`` the GPU entry
points, which pick one of the Triton forms (``two_pass.py``, ``fused.py``, ``overlap.py``, built from
``common.py``) by size; the tests check every form against the references.
"""
