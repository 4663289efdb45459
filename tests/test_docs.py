"""The documentation users get: what the code and the README cite is in the repository."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = "DESIGN" + ".md"      # the project's notes outside the repository (spelled so this file does not cite it)


def _tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / f for f in listed.stdout.splitlines() if f.endswith((".py", ".md", ".rule", ".sh", ".toml"))]


def test_every_cited_doc_is_in_the_repository():
    cited: dict[str, str] = {}
    for path in _tracked():
        text = path.read_text(errors="replace")
        assert OUTSIDE not in text, f"{path.relative_to(ROOT)} cites {OUTSIDE}, which users do not get; cite docs/"
        for doc in re.findall(r"docs/[\w./-]+\.md", text):
            cited.setdefault(doc, str(path.relative_to(ROOT)))
    assert cited, "nothing cites docs/"
    missing = {doc: by for doc, by in cited.items() if not (ROOT / doc).is_file()}
    assert not missing, f"cited but not in the repository: {missing}"
