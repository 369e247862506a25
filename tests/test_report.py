"""The HTML report: built from real results, self-contained, and rendered by a real browser."""

import functools
import html
import re
import shutil
from pathlib import Path

import pytest

from arithinterp.errors import ConfigError
from arithinterp.report import STAGES, write_report

ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    """The whole report on zoo:add-100. The page is what these tests check, so the two stages whose
    samples do not shrink with ``limit`` take smaller ones: the probes their minimum of 60 prompts and
    the error detector 900 problems of zoo:add-3digit-weak instead of 6,000 (its held-out third still
    has more than the minimum of each kind); the detector and the probes themselves are tested on their own."""
    from arithinterp import report

    out = tmp_path_factory.mktemp("report") / "report.html"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "Context", functools.partial(report.Context, n_probe_prompts=60, n_detector_prompts=900))
        return write_report("zoo:add-100", out=out, limit=400, progress=False)


@pytest.mark.slow
def test_report_is_self_contained(report_file):
    text = report_file.read_text()
    assert text.count("<script type='text/javascript'>") == 1  # plotly.js inlined exactly once
    # nothing is fetched when the file opens: no external scripts, stylesheets or images
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=[\"']?https?:", text)
    for stage in ("Accuracy and error profile", "Activation patching", "Linear probes", "Error detection",
                  "Fourier features and the helix", "Heuristic neurons"):
        assert f"<h2>{stage}</h2>" in text
    # add-100's answers are single tokens: the digit stage says why it did not run
    assert "<h2>Which head computes which answer digit</h2>" in text
    assert "Not run on this model: the answers are single tokens" in text
    # the summary quotes measured numbers, not canned text
    assert re.search(r"answers \d+ of \d+ prompts correctly \(\d+\.\d%\)", text)
    # the trained model's neurons implement heuristics more often than a random-init model's
    assert re.search(r"\d+% implement at least one heuristic .*a random-init model of the same architecture, ranked "
                     r"and scored the same way: \d+% .* — more than the control: training put them there", text)
    assert len(re.findall(r"id=\"figure-\d+\"", text)) >= 8


@pytest.mark.slow
def test_report_renders_in_chromium(report_file):
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it as root)")
    errors = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"],
        )
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report_file.as_uri())
        page.wait_for_load_state("load")
        figures = page.locator("div.figure > div > div[id^='figure-']")
        n = figures.count()
        assert n >= 8
        rendered = page.evaluate(
            "() => Array.from(document.querySelectorAll(\"div[id^='figure-']\")).map(d => d.querySelectorAll('svg.main-svg').length > 0)"
        )
        # the feature graph's and the circuit's interactive pages, each in its inline frame, drawn
        views = page.locator("iframe.graph-view").count()
        ready = [frame.evaluate("document.documentElement.dataset.ready") for frame in page.frames[1:]]
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        browser.close()
    assert all(rendered), f"{rendered.count(False)} of {len(rendered)} figures did not render"
    assert views == 2 and ready == ["true"] * views, ready
    assert not errors, errors


def test_report_rejects_bad_stage(tmp_path):
    with pytest.raises(ConfigError, match="unknown report stage"):
        write_report("zoo:add-100", out=tmp_path / "r.html", stages=["patchin"])
    assert set(STAGES) == {"accuracy", "patching", "digits", "probes", "errors", "fourier", "neurons", "circuits",
                           "features", "causal"}


@pytest.mark.slow
def test_report_on_a_digit_model_reads_numbers_of_several_tokens(tmp_path):
    """add-3digit: its numbers are several tokens, read whole at their last token for the Fourier
    stage (where a random-init model reads the last digit as well), and its answers have digits.
    A third of its operand range, three tokens each (the spectrum's shuffled-numbers control costs the
    cube of the number of numbers), whose sums cross 1000 so that pairs differ in the first answer
    token and the helix is fitted and tested too."""
    out = write_report("zoo:add-3digit", out=tmp_path / "r.html", stages=["digits", "fourier"], operands="400-699",
                       limit=200, progress=False)
    text = html.unescape(out.read_text())
    assert "not single tokens" not in text
    assert re.search(r"sample: \d+ numbers \(the residual stream entering layer 1 at each number's last token\)", text)
    assert "No signal above the control: x mod T is not linearly readable" in text  # the digit token is the residue
    assert re.search(r"costs that token most for L\dH\d on answer token \d \((−[\d.]+ points|no drop)\)", text)
    assert "A helix with periods 2, 5, 10, 100 fitted at resid_pre of layer 1 on the a token" in text
