"""Named notes: each subtle DeepSpeed behaviour is written once, as `[Note: <title>]` where the
rule lives, and cited elsewhere as `see [Note: <title>]` (code, tests, docs). A citation of a
note that does not exist, or a note written twice, fails here."""
import re
from collections import defaultdict

from tests.helpers import ROOT

NOTE = re.compile(r"(see\s+)?\[Note:\s+([A-Za-z0-9][^\]]*?)\]", re.IGNORECASE)
TREES = ("zsim", "calibration", "tests", "docs", "benchmarks")


def _notes():
    defined, cited = defaultdict(list), defaultdict(list)
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.suffix not in (".py", ".md") or path.name == "test_notes.py":
                continue
            text = path.read_text()
            for m in NOTE.finditer(text):
                title = re.sub(r"[\s#]+", " ", m.group(2)).strip()
                where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                (cited if m.group(1) else defined)[title].append(where)
    return defined, cited


def test_every_note_is_written_once_and_every_citation_resolves():
    defined, cited = _notes()
    assert len(defined) >= 8
    twice = {t: w for t, w in defined.items() if len(w) > 1}
    assert not twice, f"notes written more than once: {twice}"
    dangling = {t: w for t, w in cited.items() if t not in defined}
    assert not dangling, f"citations of notes that do not exist: {dangling}"


def test_notes_are_cited_outside_their_definition():
    defined, cited = _notes()
    lonely = [t for t, where in defined.items()
              if not any(c.split(":")[0] != where[0].split(":")[0] for c in cited.get(t, []))]
    assert not lonely, f"notes cited nowhere else: {lonely}"
