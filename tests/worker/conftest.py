"""Worker tests share the suite-wide tiny models (tests/conftest.py)."""
