"""The measured tables of the fidelity pages are rendered from the reports' JSON, so that a report
measured again fails here until its pages are rendered again.

- docs/fidelity/**/fidelity.md are what `kvguard eval --from-json` writes from the fidelity.json beside
  them (`--formats md` renders one again without measuring);
- docs/fidelity.md holds a few tables of those reports, some columns of each: TABLES says which,
  and `python tests/eval/test_fidelity_page.py` prints them as the page must hold them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.eval import report

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "fidelity.md"
REPORTS = sorted((REPO / "docs" / "fidelity").rglob("fidelity.json"))


def _load(rel: str) -> report.Report:
    return report.from_json(json.loads((REPO / rel).read_text(encoding="utf-8")))


def _columns(*wanted: str, steps: bool = True):
    """The summary table with these columns only ("gate" names the gate's column, whose heading
    states the bound); without a policy's downgrade steps (chat~1, ...) unless `steps`."""

    def render(r: report.Report) -> str:
        head, rows = report.summary_table(r)
        at = [next(i for i, h in enumerate(head) if h == w or (w == "gate" and h.startswith("gate ")))
              for w in wanted]
        return report._table([head[i] for i in at],
                             [[row[i] for i in at] for row in rows if steps or "~" not in row[0]])

    return render


def _whole(table):
    return lambda r: report._table(*table(r))


MAIN = "docs/fidelity/fidelity.json"
GEMMA = "docs/fidelity/gemma3/fidelity.json"
TABLES = {
    "SmolLM2-135M, every method and policy": (MAIN, _columns(
        "method", "configuration", "held", "read", "deviation (mean of layers)", "deviation, texts min–max",
        "worst layer", "ΔPPL", "ΔPPL, texts min–max", "gate", "retrieval", steps=False)),
    "SmolLM2-135M, policy decisions": (MAIN, _whole(report.decision_table)),
    "Gemma 3 270M, every method and policy": (GEMMA, _columns(
        "method", "configuration", "held", "read", "deviation (mean of layers)", "deviation, texts min–max",
        "worst layer", "ΔPPL", "ΔPPL, texts min–max", "gate", steps=False)),
    "Gemma 3 270M, policy decisions": (GEMMA, _whole(report.decision_table)),
    "budgets at 512 tokens, three texts": ("docs/fidelity/budgets-512/fidelity.json", _columns(
        "method", "configuration", "held", "read", "deviation (mean of layers)", "deviation, texts min–max",
        "worst layer", "ΔPPL", "ΔPPL, texts min–max", "retrieval")),
}


def rendered(name: str) -> str:
    source, render = TABLES[name]
    return render(_load(source))


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.parent.relative_to(REPO).as_posix())
def test_each_report_page_is_its_json_rendered(path):
    got = path.with_suffix(".md").read_text(encoding="utf-8")
    want = report.to_markdown(report.from_json(json.loads(path.read_text(encoding="utf-8"))))
    assert got == want, (f"{path.with_suffix('.md').relative_to(REPO)} is not its JSON rendered: run "
                         f"kvguard eval --from-json {path.relative_to(REPO)} --out {path.parent.relative_to(REPO)} "
                         "--formats md")


@pytest.mark.parametrize("name", list(TABLES))
def test_the_page_holds_the_table_as_its_report_renders_it(name):
    table = rendered(name)
    assert table in PAGE.read_text(encoding="utf-8"), (
        f"docs/fidelity.md does not hold the table {name!r} as {TABLES[name][0]} renders it now:\n{table}")


def test_every_report_is_checked():
    assert {p.relative_to(REPO).as_posix() for p in REPORTS} >= {source for source, _ in TABLES.values()}
    assert len(REPORTS) == 4  # the full runs of both models and the two budget runs


def test_the_side_by_side_page_is_the_two_reports_compared():
    from kvguard.eval.compare import load_reports, side_by_side

    got = (REPO / "docs" / "fidelity" / "side-by-side.md").read_text(encoding="utf-8")
    assert got == side_by_side(load_reports([str(REPO / MAIN), str(REPO / GEMMA)])), (
        "docs/fidelity/side-by-side.md is not the reports compared: run kvguard eval --compare "
        f"{MAIN} {GEMMA} --out docs/fidelity")


if __name__ == "__main__":
    for name in TABLES:
        print(f"<!-- {name}: {TABLES[name][0]} -->\n{rendered(name)}\n")
