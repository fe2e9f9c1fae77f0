"""The installed packages import (their layering rules: tests/unit/test_architecture.py)."""


def test_packages_import() -> None:
    import data
    import transformer

    assert transformer.__doc__ and data.__doc__
