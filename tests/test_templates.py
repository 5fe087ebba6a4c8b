"""The pages' Content-Security-Policy allows no inline script: no template may hold one (a JSON data
block, `<script type="application/json">`, is not run and is allowed), nor an inline event handler."""

import re

from tests.conftest import ROOT

SCRIPT = re.compile(r"<script\b([^>]*)>", re.I)
HANDLER = re.compile(r"<[a-z][^>]*\son[a-z]+\s*=", re.I | re.S)


def test_templates_run_no_inline_script():
    found = []
    for path in sorted((ROOT / "templates").rglob("*.html")):
        text = path.read_text()
        for m in SCRIPT.finditer(text):
            attrs = m.group(1)
            if "src=" not in attrs and 'type="application/json"' not in attrs:
                found.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: inline <script>")
        for m in HANDLER.finditer(text):
            found.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: inline event handler")
        if "javascript:" in text:
            found.append(f"{path.relative_to(ROOT)}: javascript: URL")
    assert not found, found
