"""Browser tests: every page a test opens must run without an uncaught JavaScript error, and without
anything the Content-Security-Policy refused (an inline script or handler, a resource from elsewhere)."""

import pytest

# Reported by the page itself: the event fires for every refusal, whatever the console shows.
_REPORT_CSP = """
document.addEventListener("securitypolicyviolation", (e) => {
  const where = `${e.sourceFile}:${e.lineNumber}`;
  window.__tdCspViolation(`${e.violatedDirective} refused ${e.blockedURI || "inline"} at ${where}`);
});
"""


def watch_page_errors(context, errors: list[str]) -> None:
    """Collect into `errors` the CSP refusals of every page `context` opens from now on, and their
    uncaught exceptions (the `page` event covers pages opened later)."""
    context.expose_binding("__tdCspViolation", lambda _source, text: errors.append(f"CSP: {text}"))
    context.add_init_script(_REPORT_CSP)

    def on_page(page):
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on(
            "console",
            lambda msg: (
                errors.append(msg.text) if msg.type == "error" and "Content Security Policy" in msg.text else None
            ),
        )

    for page in context.pages:
        on_page(page)
    context.on("page", on_page)


@pytest.fixture(autouse=True)
def no_uncaught_js_errors(request):
    """Fail a test whose pages threw an uncaught JavaScript exception or broke the CSP."""
    if "page" not in request.fixturenames:
        yield
        return
    errors: list[str] = []
    watch_page_errors(request.getfixturevalue("page").context, errors)
    yield
    assert not errors, f"uncaught JavaScript errors or CSP refusals: {errors}"
