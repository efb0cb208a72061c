"""Execution contracts that methods lower to: torch references, and Triton kernels beside them."""
