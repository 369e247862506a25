"""The graph viewer in a real browser (Debian's Chromium through playwright), with the network off:
what it draws is the pruned graph (or the kept circuit), the slider adds what the data orders next,
a click shows a node's details, supernodes collapse and expand, hover follows paths, and nothing is
fetched. One browser serves the module; every page is opened from ``file://``."""

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

import arithinterp as ai
from arithinterp.errors import ConfigError

pytestmark = pytest.mark.slow  # one browser for the module, pages of real graphs


def node_id(node) -> str:
    """A graph node's id in the viewer, as the data format documents it."""
    kind, layer, position = node["kind"], node["layer"], node["position"]
    return {"feature": f"L{layer}F{node['feature']}@{position}", "error": f"L{layer}err@{position}",
            "embedding": f"token@{position}", "logit": f"logit:{node['token_id']}"}[kind]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it as root)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"],
        )
        yield browser
        browser.close()


class Opened:
    """A page of the viewer, opened offline, with what it logged and requested."""

    def __init__(self, browser, view, path: Path, viewport=(1400, 820)):
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]}, offline=True)
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.context.route(re.compile(r"^(?!file:|data:|about:).*"), self._refuse)
        page = self.context.new_page()
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))
        view.to_html(path, overwrite=True)
        page.goto(path.as_uri())
        page.wait_for_function("document.documentElement.dataset.ready === 'true'", timeout=10_000)
        self.page = page

    def _refuse(self, route):
        self.requests.append(route.request.url)
        route.abort()

    def drawn(self):
        nodes = self.page.evaluate("graphView.drawnNodes()")
        links = self.page.evaluate("graphView.drawnLinks()")
        return set(nodes), {(a, b): w for a, b, w in links}

    def close(self):
        offline = [url for url in self.requests if not url.startswith(("file:", "data:", "about:"))]
        errors = list(self.errors)
        self.context.close()
        assert not offline, f"the page asked the network for {offline}"
        assert not errors, errors


def expected_links(graph, shown: set) -> dict:
    """The graph's non-zero edges between nodes whose ids are in ``shown``: {(source, target): weight}."""
    ids = [node_id(n) for n in graph.nodes]
    t, s = graph.edges.nonzero(as_tuple=True)
    return {(ids[j], ids[i]): float(graph.edges[i, j]) for i, j in zip(t.tolist(), s.tolist())
            if ids[i] in shown and ids[j] in shown}


def same_links(drawn: dict, expected: dict) -> None:
    assert set(drawn) == set(expected)
    for key, weight in expected.items():  # the page holds 4 significant digits
        assert math.isclose(drawn[key], weight, rel_tol=1e-3, abs_tol=1e-12), (key, drawn[key], weight)


@pytest.fixture(scope="module")
def add100():
    from arithinterp.features import load_transcoders

    model = ai.load_model("zoo:add-100")
    return model, load_transcoders("zoo:add-100")


@pytest.fixture(scope="module")
def graphs(add100, tiny_model):
    """Three graphs: the zoo's 47+38= and 136+259=, and a random 2-layer model's over random transcoders."""
    from arithinterp.features import Transcoders, load_transcoders
    from arithinterp.features.graph import prompt_graph

    model, transcoders = add100
    digits = ai.load_model("zoo:add-3digit")
    g = torch.Generator().manual_seed(0)
    d, F, L = tiny_model.cfg.d_model, 48, tiny_model.cfg.n_layers
    random = Transcoders(W_enc=torch.randn(L, d, F, generator=g) / d ** 0.5, b_enc=torch.zeros(L, F),
                         W_dec=torch.randn(L, F, d, generator=g) / F ** 0.5, b_dec=torch.zeros(L, d),
                         W_skip=torch.zeros(L, d, d), layers=list(range(L)), k=6, metrics={}, meta={})
    return {
        "47+38=": prompt_graph(model, "47+38=", transcoders, progress=False),
        "136+259=": prompt_graph(digits, "136+259=", load_transcoders("zoo:add-3digit"), progress=False),
        "random": prompt_graph(tiny_model, "36+59=", random, n_logits=2, max_nodes=20, progress=False),
    }


@pytest.mark.parametrize("name", ["47+38=", "136+259=", "random"])
def test_the_page_draws_the_pruned_graph(browser, graphs, name, tmp_path):
    graph = graphs[name]
    opened = Opened(browser, graph.show(), tmp_path / "graph.html")
    nodes, links = opened.drawn()
    kept = {node_id(n) for n in graph.nodes if n["kept"]}
    assert nodes == kept
    same_links(links, expected_links(graph, kept))
    assert len(links) == len(graph.to_frame(kept_only=True))
    opened.close()


def test_the_slider_adds_source_nodes_by_influence(browser, graphs, tmp_path):
    graph = graphs["136+259="]
    opened = Opened(browser, graph.show(max_drawn=2000), tmp_path / "graph.html")
    sources = sorted((n for n in graph.nodes if n["kind"] != "logit"), key=lambda n: (not n["kept"], -n["influence"]))
    logits = {node_id(n) for n in graph.nodes if n["kind"] == "logit"}
    for k in (40, 3, 90):
        opened.page.locator("#slider").fill(str(k))  # what a user's drag does: the input event
        nodes, links = opened.drawn()
        shown = logits | {node_id(n) for n in sources[:k]}
        assert nodes == shown
        same_links(links, expected_links(graph, shown))
        text = opened.page.locator(".slider-text").inner_text()
        assert text.startswith(f"{k} of {len(sources)} source nodes") and f"{len(links):,} links drawn" in text
    # every node: more links than max_drawn, of which the strongest are drawn
    opened.page.locator("#slider").fill(str(len(sources)))
    nodes, links = opened.drawn()
    every = {key: float(f"{w:.4g}") for key, w in expected_links(graph, nodes).items()}
    assert len(links) == 2000 and set(links) <= set(every) and len(every) == int((graph.edges != 0).sum())
    assert min(abs(w) for w in links.values()) >= max(abs(w) for key, w in every.items() if key not in links)
    assert f"the strongest 2,000 of {len(every):,} links drawn" in opened.page.locator(".slider-text").inner_text()
    opened.page.locator("#pruned").click()
    assert opened.drawn()[0] == {node_id(n) for n in graph.nodes if n["kept"]}
    opened.close()


@pytest.fixture(scope="module")
def labelled(add100, graphs):
    """The 47+38= graph with two kept layer-0 features under one label and operand plots of its kept features."""
    from arithinterp.features.operand_plots import graph_feature_grids, operand_plots
    from arithinterp.tasks import arithmetic, parse_prompt

    model, transcoders = add100
    graph = graphs["47+38="]
    kept = sorted((n for n in graph.nodes if n["kept"] and n["kind"] == "feature" and n["layer"] == 0),
                  key=lambda n: -n["influence"])
    grouped = kept[:2]
    labels = {(n["layer"], n["feature"]): "magnitude" for n in grouped}
    labels[(kept[2]["layer"], kept[2]["feature"])] = "ones digit"
    grid = arithmetic(model, "+", range(0, 100, 5), range(0, 100, 5), "{a}+{b}=")
    plots = operand_plots(model, grid, transcoders, roles=["a", "b", "final"], progress=False)
    grids = graph_feature_grids(graph, plots, parse_prompt(model, "47+38="))
    return graph, grouped, kept[2], labels, grids


def test_clicking_a_feature_shows_its_details_and_operand_plot(browser, labelled, tmp_path):
    graph, _, feature, labels, grids = labelled
    opened = Opened(browser, graph.show(labels=labels, grids=grids), tmp_path / "graph.html")
    page = opened.page
    fid = node_id(feature)
    page.locator(f'g.node[data-id="{fid}"] .shape').click()
    panel = page.locator("aside.panel")
    text = panel.inner_text()
    assert f"L0 #{feature['feature']}" in text and "ones digit" in text
    assert f"{feature['activation']:.4g}" in text and f"{feature['influence']:.4g}" in text
    # its strongest input, from the graph's own edges
    index = next(i for i, n in enumerate(graph.nodes) if node_id(n) == fid)
    strongest = int(graph.edges[index].abs().argmax())
    source = graph.nodes[strongest]
    name = source["token"] if source["kind"] == "embedding" else f"L{source['layer']} #{source['feature']}"
    assert panel.locator("ol.links li a").first.inner_text() == f"{name} @{source['position']}"
    # the operand plot: hover over a cell and read its value back
    result = next(r for r in grids if r.layer == 0)
    j = result.features.index(feature["feature"])
    maps = result.maps[j]
    canvas = panel.locator("canvas.heatmap")
    box = canvas.bounding_box()
    assert box is not None
    ia, ib = 7, 12
    cell = 200 / len(result.b_values), 200 / len(result.a_values)  # the plot's 200 px square, 30 px from the left
    page.mouse.move(box["x"] + 30 + (ib + 0.5) * cell[0], box["y"] + 2 + (ia + 0.5) * cell[1])
    caption = panel.locator(".grid-value").inner_text()
    found = re.fullmatch(rf"a = {result.a_values[ia]}, b = {result.b_values[ib]}: activation (\S+)", caption)
    assert found, caption
    span = float(maps.max() - maps.min())
    assert abs(float(found.group(1)) - float(maps[ia, ib])) <= span / 254 + 1e-3 * abs(float(maps[ia, ib]))
    opened.close()


def test_supernodes_collapse_into_one_node_and_expand_on_click(browser, labelled, tmp_path):
    graph, grouped, _, labels, _ = labelled
    opened = Opened(browser, graph.show(labels=labels), tmp_path / "graph.html")
    members = {node_id(n) for n in grouped}
    kept = {node_id(n) for n in graph.nodes if n["kept"]}
    nodes, links = opened.drawn()
    assert "group:magnitude" in nodes and not members & nodes and nodes == (kept - members) | {"group:magnitude"}
    # the supernode's link to the answer is its members' summed
    logit = next(node_id(n) for n in graph.nodes if n["kind"] == "logit")
    full = expected_links(graph, kept)
    assert math.isclose(links[("group:magnitude", logit)], sum(full[(m, logit)] for m in members), rel_tol=1e-3)
    opened.page.locator('g.node[data-id="group:magnitude"] .shape').click()
    nodes, links = opened.drawn()
    assert nodes == kept
    same_links(links, full)
    opened.page.locator("aside.panel button[data-expand]").click()  # collapse it again from the panel
    assert opened.drawn()[0] == (kept - members) | {"group:magnitude"}
    opened.close()


def test_hover_highlights_the_paths_through_a_node(browser, graphs, tmp_path):
    graph = graphs["47+38="]
    opened = Opened(browser, graph.show(), tmp_path / "graph.html")
    kept = {node_id(n) for n in graph.nodes if n["kept"]}
    links = set(expected_links(graph, kept))
    node = next(node_id(n) for n in graph.nodes if n["kept"] and n["kind"] == "feature" and n["layer"] == 0)
    ancestors, descendants = {node}, {node}
    for _ in range(len(kept)):  # the closure over the drawn links, computed here
        ancestors |= {a for a, b in links if b in ancestors}
        descendants |= {b for a, b in links if a in descendants}
    on_path = {(a, b) for a, b in links if b in ancestors or a in descendants}
    opened.page.locator(f'g.node[data-id="{node}"] .shape').hover()
    assert {tuple(x) for x in opened.page.evaluate("graphView.highlightedLinks()")} == on_path
    dimmed = set(opened.page.evaluate("Array.from(document.querySelectorAll('g.node.dim'), g => g.dataset.id)"))
    assert dimmed == kept - ancestors - descendants
    opened.page.mouse.move(5, 5)
    assert opened.page.evaluate("graphView.highlightedLinks()") == []
    opened.close()


@pytest.fixture(scope="module")
def circuit(add100):
    from arithinterp import circuits
    from arithinterp.models.zoo import task_prompts

    model, _ = add100
    pairs = task_prompts(model, "zoo:add-100", 40, 0).correct_only(model).counterfactual(vary="a", seed=0)
    scored = circuits.score_edges(model, pairs, "eap", positions=["a", "b", "final"], progress=False)
    return circuits.top_n(scored, 40)


def circuit_links(circuit, edges) -> dict:
    def at(name, position):
        return f"{name}@{position}"

    return {(at(circuit.senders[i], circuit.positions[i]), at(circuit.receivers[i], circuit.positions[i]),
             circuit.channels[i]): float(circuit.scores[i]) for i in edges}


def test_the_page_draws_the_kept_circuit_and_the_slider_adds_edges_by_score(browser, circuit, tmp_path):
    opened = Opened(browser, circuit.show(), tmp_path / "circuit.html")
    by_score = sorted(range(circuit.n_edges), key=lambda i: (not bool(circuit.kept[i]), -abs(float(circuit.scores[i]))))
    for k in (None, 120, 7):
        if k is not None:
            opened.page.locator("#slider").fill(str(k))
        edges = by_score[: circuit.n_kept if k is None else k]
        expected = circuit_links(circuit, edges)
        nodes = set(opened.page.evaluate("graphView.drawnNodes()"))
        drawn = {(a, b, c): w for a, b, w, c in opened.page.evaluate("graphView.drawnLinks()")}
        assert nodes == {n for a, b, _ in expected for n in (a, b)}
        same_links(drawn, expected)  # q, k and v edges between two nodes are drawn apart, each with its score
    top = by_score[0]
    receiver = f"{circuit.receivers[top]}@{circuit.positions[top]}"
    opened.page.locator(f'g.node[data-id="{receiver}"] .shape').click()
    assert f"{float(circuit.scores[top]):.4g}" in opened.page.locator("aside.panel").inner_text()
    opened.close()


def test_the_notebook_frame_draws_the_same_page(browser, graphs, tmp_path):
    """``_repr_html_`` is the page in an ``<iframe srcdoc>``: no server, nothing fetched."""
    graph = graphs["random"]
    view = graph.show()
    (tmp_path / "notebook.html").write_text(f"<!DOCTYPE html><html><body>{view._repr_html_()}</body></html>")
    context = browser.new_context(offline=True)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto((tmp_path / "notebook.html").as_uri())
    frame = page.frames[1]
    frame.wait_for_function("document.documentElement.dataset.ready === 'true'", timeout=10_000)
    assert set(frame.evaluate("graphView.drawnNodes()")) == {node_id(n) for n in graph.nodes if n["kept"]}
    context.close()
    assert not errors


# ---- the data and the files (no browser) ---------------------------------------------------------------


def test_a_large_graph_keeps_the_pruned_graph_and_each_nodes_strongest_links(graphs):
    from arithinterp.viz.graph_view import graph_data
    from arithinterp.viz.graph_view.data import STRONGEST

    graph = graphs["136+259="]
    data = graph_data(graph, max_links=500)
    ids = data["nodes"]["id"]
    held = {(ids[s], ids[t]) for s, t in zip(data["links"]["source"], data["links"]["target"])}
    kept = {node_id(n) for n in graph.nodes if n["kept"]}
    assert set(expected_links(graph, kept)) <= held
    names = [node_id(n) for n in graph.nodes]
    for i in range(len(graph.nodes)):  # each target's strongest incoming edges
        row = graph.edges[i].abs()
        for j in row.topk(STRONGEST).indices.tolist():
            if float(row[j]) > 0:
                assert (names[j], names[i]) in held
    n_nonzero = int((graph.edges != 0).sum())
    assert len(held) < n_nonzero and f"{len(held):,} of the graph's {n_nonzero:,} non-zero edges" in data["notes"][0]
    assert len(graph_data(graph)["links"]["source"]) == n_nonzero  # below max_links: every edge


def test_bad_options_are_refused_with_what_is_accepted(graphs, circuit, tmp_path):
    from arithinterp.viz.graph_view import graph_data, render_page, view_circuit

    graph = graphs["47+38="]
    feature = next(n for n in graph.nodes if n["kind"] == "feature")
    with pytest.raises(ConfigError, match="max_links=0 is not accepted"):
        graph_data(graph, max_links=0)
    with pytest.raises(ConfigError, match="its parameters are graph, labels, supernodes"):
        graph.show(supernode=[])
    with pytest.raises(ConfigError, match=r"keyed by \(layer, feature\) pairs of ints"):
        graph.show(labels={"L0#18": "x"})
    with pytest.raises(ConfigError, match="is not a group"):
        graph.show(supernodes=[{"name": "x"}])
    with pytest.raises(ConfigError, match="is in both 'a' and 'b'"):
        graph.show(supernodes={"a": [(feature["layer"], feature["feature"])], "b": [node_id(feature)]})
    with pytest.raises(ConfigError, match="member 3.5 is not accepted"):
        graph.show(supernodes={"a": [3.5]})
    with pytest.raises(ConfigError, match="graph must be a features.AttributionGraph"):
        graph_data(circuit)
    with pytest.raises(ConfigError, match="circuit must be a circuits.Circuit"):
        view_circuit(graph)
    with pytest.raises(ConfigError, match="graph-view description"):
        render_page({"nodes": []})
    out = graph.to_html(tmp_path / "g.html")
    assert out.read_text().startswith("<!DOCTYPE html>")
    with pytest.raises(ConfigError, match="already exists; pass overwrite=True"):
        graph.to_html(tmp_path / "g.html")
    assert circuit.to_html(tmp_path / "g.html", overwrite=True).read_text().count("arithinterp-graph-view") == 1


def page_data(path: Path) -> dict:
    """The description a written page draws (its JSON, unescaped as the browser reads it)."""
    import json

    text = path.read_text(encoding="utf-8")
    found = re.search(r"<script type='application/json' id='graph-data'>(.*?)</script>", text, re.S)
    assert found and "</" not in found.group(1)
    return json.loads(found.group(1))


def test_the_commands_write_the_pages(tmp_path, capsys):
    import json

    from arithinterp.cli import main

    page = tmp_path / "graph.html"
    assert main(["graph", "zoo:add-100", "36+59=", "--html", str(page), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    data = page_data(page)
    assert summary["html"] == str(page) and data["kind"] == "graph"
    assert data["slider"]["default"] == summary["scores"]["n_kept"] - data["nodes"]["kind"].count("logit")
    assert main(["graph", "zoo:add-100", "36+59=", "--html", str(page)]) == 2  # exists: refused before any work
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["graph", "zoo:add-100", "36+59=", "--grids"]) == 2
    assert "give --html FILE too" in capsys.readouterr().err
    page = tmp_path / "circuit.html"
    assert main(["circuit", "--method", "eap", "--top", "25", "--limit", "100", "--no-progress", "--json",
                 "--html", str(page)]) == 0
    summary = json.loads(capsys.readouterr().out)
    data = page_data(page)
    assert data["kind"] == "circuit" and data["slider"]["default"] == summary["kept"] == 25
    assert len(data["links"]["source"]) == summary["edges"]
