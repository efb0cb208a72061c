"""Quest's kernels: page summaries kept as keys are appended and the page bounds in one launch
(``quest_pages.py``), selected by ``shared/select_triton.py``; the reference beside them."""
