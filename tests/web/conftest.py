"""Browser tests: every page a test opens must run without an uncaught JavaScript error."""

import pytest


@pytest.fixture(autouse=True)
def no_uncaught_js_errors(request):
    """Fail a test whose pages threw an uncaught JavaScript exception."""
    if "page" not in request.fixturenames:
        yield
        return
    errors: list[str] = []
    request.getfixturevalue("page").on("pageerror", lambda exc: errors.append(str(exc)))
    yield
    assert not errors, f"uncaught JavaScript errors: {errors}"
