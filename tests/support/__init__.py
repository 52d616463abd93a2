"""What several test modules and child programs share: fixtures' building blocks, stand-ins,
references and launchers, one module per kind of thing (tests/conftest.py holds the fixtures
themselves). Importable as `support.<module>`: pyproject.toml puts tests/ on pytest's path, and the
programs in tests/programs/ that use it put it on theirs. No test module imports another test
module; tests/project/test_tests_layout.py checks it."""
