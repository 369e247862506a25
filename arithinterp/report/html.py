"""The report's page: one self-contained HTML file (plotly.js inlined once), rewritten as each
stage starts and ends (:class:`Page`), so that a run stopped at any point leaves a readable page.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Optional

from arithinterp.outputs import write_file
from arithinterp.report.stage import Section

_STYLE = """
body { font-family: Inter, Helvetica, Arial, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
section { border-top: 1px solid #ddd; margin-top: 2em; padding-top: 0.5em; }
.findings li { margin: 0.3em 0; } .figure, .viewer { margin: 1em 0; } .seconds { color: #999; font-size: 0.85em; }
.sample { color: #555; font-size: 0.9em; } .state { font-weight: bold; } .status li { margin: 0.15em 0; }
"""


def section_html(section: Section, first_figure: int = 0) -> str:
    """One section's HTML.

    Args:
        section: The stage's section.
        first_figure: The number of its first figure (figure ids are unique in the page).

    Returns:
        The ``<section>`` element.
    """
    parts = [f"<section><h2>{html.escape(section.title)}</h2>"]
    if section.sample:
        parts.append(f"<p class='sample'>sample: {html.escape(section.sample)}</p>")
    parts.append("<ul class='findings'>")
    parts += [f"<li>{html.escape(line)}</li>" for line in section.findings]
    parts.append("</ul>")
    for i, fig in enumerate(section.figures):
        div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{first_figure + i}")
        parts.append(f"<div class='figure'>{div}</div>")
    parts += [f"<div class='viewer'>{view.iframe()}</div>" for view in section.views]  # each its own page, inline
    parts.append(f"<p class='seconds'>computed in {section.seconds:.1f} s</p></section>")
    return "\n".join(parts)


def render(title: str, meta: dict, sections: list[Section], status: Optional[list[tuple[str, str]]] = None,
           note: str = "", bodies: Optional[list[str]] = None, plan: str = "") -> str:
    """One self-contained HTML page; plotly.js is inlined once.

    Args:
        title: The page's title.
        meta: Provenance, listed under the title.
        sections: The stages' sections.
        status: ``(stage title, state)`` lines listed under the title.
        note: A paragraph under the title.
        bodies: The sections' HTML when already rendered (:func:`section_html`).
        plan: The report's plan, as the element that carries it (:func:`arithinterp.report.plan.plan_html`).

    Returns:
        The page's HTML.
    """
    from plotly.offline import get_plotlyjs

    if bodies is None:
        bodies, first = [], 0
        for section in sections:
            bodies.append(section_html(section, first))
            first += len(section.figures)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>",
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<p class='meta'>"
        + " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items())
        + "</p>",
    ]
    if note:
        parts.append(f"<p class='state'>{html.escape(note)}</p>")
    if status:
        parts.append("<h2>Stages</h2><ul class='status'>")
        parts += [f"<li><b>{html.escape(name)}</b>: {html.escape(state)}</li>" for name, state in status]
        parts.append("</ul>")
    parts += [
        "<h2>Summary</h2><ul class='findings'>",
        *[f"<li><b>{html.escape(s.title)}.</b> {html.escape(s.findings[0])}</li>" for s in sections if s.findings],
        "</ul>",
        *bodies,
        *([plan] if plan else []),
        "</body></html>",
    ]
    return "\n".join(parts)


FINISHED = ("done", "not enough data", "not run", "skipped", "failed")  # the states of a stage that has ended


class Page:
    """The report as it stands, rewritten to ``out`` (whole, by the guarded writer) whenever a stage
    starts or ends, so that a run stopped at any point (killed, interrupted, out of memory) leaves a
    readable page listing what finished, what was running and what was not yet run. ``titles``: each
    stage's title by name. ``replaces``: the page the run writes when it ends (:meth:`finish`), when
    ``out`` is a file beside it (an old page kept until the new one is complete)."""

    def __init__(self, out: Path, title: str, meta: dict, names: list[str], titles: dict[str, str],
                 replaces: Optional[Path] = None):
        self.out, self.title, self.meta, self.start = out, title, meta, time.perf_counter()
        self.replaces = out if replaces is None else replaces  # the page written when the run ends
        self.titles = titles
        self.names = ["evaluation", *names]
        self.state = {name: "not yet run" for name in self.names}
        self.sections: list[Section] = []
        self.bodies: list[str] = []
        self.figures = 0
        self.note = ""
        self.interrupted = False  # stopped between stages (Ctrl-C while the page was written)
        self.plan = ""  # the plan's element, once the stages are planned

    def set(self, name: str, state: str) -> None:
        self.state[name] = state
        self.write()

    def add(self, name: str, section: Section, state: str) -> None:
        body = section_html(section, self.figures)  # figures rendered once, not at every write
        self.sections.append(section)
        self.bodies.append(body)
        self.figures += len(section.figures)
        self.set(name, state)

    def outcome(self) -> str:
        """The closing line of a finished run: how many stages reached a finding, and for the rest
        why not and what to change. "Complete" only when every stage ran on enough data."""
        states = [self.state[n] for n in self.names[1:]]
        counts = {kind: sum(1 for st in states if st.startswith(kind)) for kind in FINISHED}
        total = len(states)
        apply = "does not apply" if counts["not run"] == 1 else "do not apply"
        if counts["done"] + counts["not run"] == total:
            return (f"Complete: all {total} stages ran and state their findings below." if not counts["not run"] else
                    f"Complete: {counts['done']} of {total} stages state findings; {counts['not run']} {apply} "
                    "to this model (their sections say why).")
        missing = [f"{counts[kind]} {label}" for kind, label in (
            ("not enough data", "had not enough data"), ("skipped", "did not fit the budget"),
            ("failed", "failed"), ("not run", f"{apply} to this model")) if counts[kind]]
        advice = []
        if counts["not enough data"]:
            advice.append("too few correctly answered prompts: give the report more time (--budget), more prompts "
                          "(--limit, --operands) or an easier task (smaller operands, more --few-shot examples)")
        if counts["skipped"]:
            advice.append("over budget: give the report more time (--budget)")
        if counts["failed"]:
            advice.append("failed: the reasons are in their sections")
        text = "; ".join(advice)
        return (f"Finished with gaps: {counts['done']} of {total} stages state findings; " + ", ".join(missing)
                + (f". {text[:1].upper()}{text[1:]}." if text else "."))

    def write(self) -> Path:
        finished = sum(1 for n in self.names[1:] if self.state[n].startswith(FINISHED))
        running = [self.titles.get(n, "evaluation") for n in self.names if self.state[n].startswith("running")]
        stopped = [n for n in self.names if self.state[n].startswith("interrupted")]
        total = len(self.names) - 1
        if stopped or self.interrupted:
            note = f"Interrupted: {finished} of {total} stages finished before the run was stopped."
        elif finished == total:
            note = self.outcome()
        else:
            note = (f"Partial page: {finished} of {total} stages finished"
                    + (f", {running[0]} running" if running else "") + "; the page is rewritten as each stage ends.")
        meta = dict(self.meta, seconds=round(time.perf_counter() - self.start, 1))
        status = [("Evaluating the task" if n == "evaluation" else self.titles[n], self.state[n]) for n in self.names]
        if self.replaces != self.out and finished != total:
            note += f" {self.replaces} keeps the previous page until this run ends."
        page = render(self.title, meta, self.sections, status, note or self.note, self.bodies, self.plan)
        return write_file(self.out, page, overwrite=True, what="out")  # the run's own page, rewritten

    def finish(self) -> Path:
        """Write the page a last time, where it belongs: a page written beside an old one (``NAME.in-progress.html``)
        takes its place now that the run is complete, and the file beside it is removed. Returns the page's path."""
        written = self.write()
        if written == self.replaces:
            return written
        final = write_file(self.replaces, written.read_bytes(), overwrite=True, what="out")
        written.unlink(missing_ok=True)
        return final
