"""Bernoulli qKᵀ (sparse ternary queries): ``reference.py`` holds the torch math of the estimators;
``feature_major.py`` a Triton score kernel over a feature-major copy of K, beside its reference."""
