"""What several methods share, used only through these modules' public functions: index-set algebra
(``selection``), the selection-method base (``base``), page scoring (``pages``), exact attention and
the covered-budget fallback (``exact``), and the backend choice (``backend``)."""
