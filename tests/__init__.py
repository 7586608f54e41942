"""kvguard's tests. Importing kvguard first lets a test process started in the checkout's root
(pytest, or `python -c "import tests..."`) import Hugging Face's `kernels`, which transformers
loads, rather than the checkout's kernels/ folder (kvguard/_checkout.py)."""

import kvguard  # noqa: F401
