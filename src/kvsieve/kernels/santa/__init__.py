"""S²ANTA (stochastic sparse attention): tile statistics and systematic sampling of V rows.

``reference.py`` and ``systematic.py`` hold the float64 torch references; ``kernels.py`` and
``overlap.py`` the Triton kernels that reproduce them (checked against them in the tests).
"""
