"""tests/ is a package (imported as tests.*); shared helpers live in tests/helpers.py."""
