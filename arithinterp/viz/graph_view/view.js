/* arithinterp's graph viewer: draws the description in <script id="graph-data"> (its fields are
 * documented in arithinterp/viz/graph_view/data.py). Nodes are SVG elements laid out by row (layer)
 * and column (token position); links are drawn on a canvas underneath, batched by colour and width.
 *
 * The slider shows a prefix of an order fixed by the data: graphs order their source nodes
 * (a node's rank), circuits their links. Every link gets the rank at which it appears (the larger
 * of its ends' ranks, or its own place), and the links are sorted by it once, so a slider move
 * draws the visible prefix without scanning the rest. Supernodes map their members onto one node
 * while collapsed; links between the same two drawn nodes are then summed.
 *
 * window.graphView exposes what is drawn (drawnNodes, drawnLinks, highlightedLinks) and the
 * actions (setSlider, select, hover, expand, collapse) for scripts and tests. No network is used.
 */
(function () {
  'use strict';

  const data = JSON.parse(document.getElementById('graph-data').textContent);
  const nodes = data.nodes;
  const links = data.links;
  const N = nodes.id.length;
  const E = links.source.length;
  const groups = data.groups || [];
  const G = groups.length;
  const SRC = Int32Array.from(links.source);
  const DST = Int32Array.from(links.target);
  const WEIGHT = Float64Array.from(links.weight, (w) => (w === null ? 0 : w));
  const CHANNEL = links.channel || null;
  const isCircuit = data.kind === 'circuit';
  const POSITIVE = '#2166ac';
  const NEGATIVE = '#b2182b';
  const SVGNS = 'http://www.w3.org/2000/svg';

  // ---- ranks: what the slider shows at k is every node and link of rank < k -------------------
  const nodeRank = new Float64Array(N);
  const linkRank = new Float64Array(E);
  if (data.slider.by === 'nodes') {
    for (let i = 0; i < N; i++) nodeRank[i] = nodes.rank[i];
    for (let e = 0; e < E; e++) linkRank[e] = Math.max(nodeRank[SRC[e]], nodeRank[DST[e]]);
  } else {
    nodeRank.fill(Infinity);
    for (let e = 0; e < E; e++) {
      linkRank[e] = e;
      if (e < nodeRank[SRC[e]]) nodeRank[SRC[e]] = e;
      if (e < nodeRank[DST[e]]) nodeRank[DST[e]] = e;
    }
  }
  const linkOrder = Uint32Array.from({ length: E }, (_, i) => i).sort((a, b) => linkRank[a] - linkRank[b] || a - b);
  const linkRankSorted = Float64Array.from(linkOrder, (e) => linkRank[e]);
  const smallest = new Float64Array(E);  // the smallest |weight| among the first e + 1 links (circuits' order)
  for (let e = 0; e < E; e++) smallest[e] = Math.min(e ? smallest[e - 1] : Infinity, Math.abs(WEIGHT[e]));
  const strongOrder = Uint32Array.from({ length: E }, (_, i) => i)
    .sort((a, b) => Math.abs(WEIGHT[b]) - Math.abs(WEIGHT[a]) || a - b);
  const maxDrawn = data.max_drawn || E;
  let linksLimited = 0;  // the links the slider shows when more than maxDrawn (only the strongest are drawn)

  function visibleLinkCount(k) {  // the links of rank < k are a prefix of linkOrder
    let lo = 0, hi = E;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (linkRankSorted[mid] < k) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  // ---- each node's links, strongest first (the panel's inputs and outputs) --------------------
  function adjacency(from) {
    const start = new Int32Array(N + 1);
    for (let e = 0; e < E; e++) start[from[e] + 1]++;
    for (let i = 0; i < N; i++) start[i + 1] += start[i];
    const list = new Int32Array(E);
    const fill = start.slice(0, N);
    for (let e = 0; e < E; e++) list[fill[from[e]]++] = e;
    for (let i = 0; i < N; i++) {
      const part = list.subarray(start[i], start[i + 1]);
      part.sort((a, b) => Math.abs(WEIGHT[b]) - Math.abs(WEIGHT[a]));
    }
    return { start, list };
  }
  let inputs = null, outputs = null;  // built on first use

  // ---- supernodes --------------------------------------------------------------------------------
  const groupOf = new Int32Array(N).fill(-1);
  const collapsed = new Uint8Array(G).fill(1);
  groups.forEach((g, j) => g.members.forEach((m) => { groupOf[m] = j; }));

  // ---- the page -----------------------------------------------------------------------------------
  const app = document.getElementById('app');
  app.innerHTML = '';
  const el = (tag, attrs, parent, text) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  };
  const header = el('header', {}, app);
  el('div', { class: 'title' }, header, data.title);
  el('div', { class: 'subtitle' }, header, data.subtitle || '');
  const controls = el('div', { class: 'controls' }, header);
  el('label', { for: 'slider' }, controls, isCircuit ? 'edges by |score|' : 'nodes by influence');
  const slider = el('input', { id: 'slider', type: 'range', min: '0', max: String(data.slider.count), step: '1' },
    controls);
  slider.value = String(data.slider.default);
  const buttons = el('span', { class: 'buttons' }, controls);
  const pruned = el('button', { type: 'button', id: 'pruned' }, buttons, isCircuit ? 'kept edges' : 'pruned graph');
  let expandAll = null, collapseAll = null;
  if (G) {
    expandAll = el('button', { type: 'button', id: 'expand-all' }, buttons, 'expand supernodes');
    collapseAll = el('button', { type: 'button', id: 'collapse-all' }, buttons, 'collapse supernodes');
  }
  const resetView = el('button', { type: 'button', id: 'reset-view' }, buttons, 'reset zoom');
  el('span', { class: 'legend' }, controls, 'blue: positive, red: negative, width ∝ |weight| · '
    + 'scroll to zoom, drag to pan · hover: paths · click: details');
  // on a line of its own, one line high: a header whose height changed with the count would move the graph
  const sliderText = el('div', { class: 'slider-text' }, header);
  for (const note of data.notes || []) el('div', { class: 'note' }, header, note);

  const main = el('div', { class: 'main' }, app);
  const stage = el('div', { class: 'stage' }, main);
  const canvas = el('canvas', {}, stage);
  const svg = document.createElementNS(SVGNS, 'svg');
  stage.appendChild(svg);
  const viewport = document.createElementNS(SVGNS, 'g');
  svg.appendChild(viewport);
  const axes = document.createElementNS(SVGNS, 'g');
  axes.setAttribute('class', 'axes');
  viewport.appendChild(axes);
  const nodeLayer = document.createElementNS(SVGNS, 'g');
  viewport.appendChild(nodeLayer);
  const tooltip = el('div', { class: 'tooltip' }, stage);
  const panel = el('aside', { class: 'panel' }, main);
  el('p', { class: 'hint' }, panel, 'Click a node for its details. Hover over one to follow its paths.');

  // ---- node elements: one per node and one per supernode, made once ------------------------------
  const items = N + G;  // item i < N is node i; item N + j is supernode j
  const itemEl = new Array(items);
  const shapeEl = new Array(items);
  const textEl = new Array(items);
  const svgEl = (tag, cls) => {
    const e = document.createElementNS(SVGNS, tag);
    if (cls) e.setAttribute('class', cls);
    return e;
  };
  for (let i = 0; i < items; i++) {
    const g = svgEl('g', i < N ? `node hidden kind-${nodes.kind[i]}` : 'node hidden supernode');
    g.dataset.id = i < N ? nodes.id[i] : `group:${groups[i - N].name}`;
    g.dataset.item = String(i);
    const shape = svgEl('path', 'shape');
    g.appendChild(shape);
    const text = svgEl('text', 'name');
    g.appendChild(text);
    nodeLayer.appendChild(g);
    itemEl[i] = g; shapeEl[i] = shape; textEl[i] = text;
  }

  // ---- geometry -----------------------------------------------------------------------------------
  const MARGIN = { left: 84, right: 14, top: 14, bottom: 46 };
  let width = 0, height = 0, bandH = 0, colW = 0;
  const R = data.rows.length, C = Math.max(1, data.columns.length);
  const rowY = (r) => MARGIN.top + (R - 1 - r + 0.5) * bandH;
  const colX = (c) => MARGIN.left + (c + 0.5) * colW;

  // a token as drawn: line breaks and tabs shown, a token of spaces shown as such
  const visible = (token) => token.replace(/\n/g, '⏎').replace(/\t/g, '⇥')
    .replace(/^ +$/, (spaces) => '␣'.repeat(spaces.length));

  function drawAxes() {
    axes.textContent = '';
    for (let r = 0; r < R; r++) {
      const line = svgEl('line', 'row-line');
      line.setAttribute('x1', MARGIN.left); line.setAttribute('x2', width - MARGIN.right);
      line.setAttribute('y1', rowY(r)); line.setAttribute('y2', rowY(r));
      axes.appendChild(line);
      const t = svgEl('text', 'row-label');
      t.setAttribute('x', MARGIN.left - 8); t.setAttribute('y', rowY(r) + 4);
      t.textContent = data.rows[r];
      axes.appendChild(t);
    }
    const chars = Math.max(3, Math.floor(colW / 6.5));
    for (let c = 0; c < data.columns.length; c++) {
      if (c > 0) {
        const line = svgEl('line', 'col-line');
        line.setAttribute('x1', MARGIN.left + c * colW); line.setAttribute('x2', MARGIN.left + c * colW);
        line.setAttribute('y1', MARGIN.top); line.setAttribute('y2', height - MARGIN.bottom);
        axes.appendChild(line);
      }
      const token = visible(data.columns[c]);
      const t = svgEl('text', 'col-label');
      t.setAttribute('x', colX(c)); t.setAttribute('y', height - MARGIN.bottom + 16);
      t.textContent = token.length > chars ? token.slice(0, chars - 1) + '…' : token;
      const title = svgEl('title');
      title.textContent = isCircuit ? token : `position ${c}: ${JSON.stringify(data.columns[c])}`;
      t.appendChild(title);
      axes.appendChild(t);
      if (!isCircuit) {
        const p = svgEl('text', 'col-index');
        p.setAttribute('x', colX(c)); p.setAttribute('y', height - MARGIN.bottom + 30);
        p.textContent = String(c);
        axes.appendChild(p);
      }
    }
  }

  // ---- state of the drawing -----------------------------------------------------------------------
  const shown = new Uint8Array(items);  // drawn now
  const px = new Float64Array(items), py = new Float64Array(items), pr = new Float64Array(items);
  const rep = new Int32Array(N);  // the item a node is drawn as (-1: not drawn)
  let drawnA = new Int32Array(0), drawnB = new Int32Array(0), drawnW = new Float64Array(0), drawnC = [];
  let drawnCount = 0;
  let linkState = null;  // per drawn link: 0 normal, 1 dimmed, 2 highlighted (while hovering)
  let onPath = null;  // per item, while hovering
  let selected = -1;
  let hovered = -1;
  let zoom = { s: 1, x: 0, y: 0 };
  const influence = nodes.influence || null;

  function shapePath(kind, r) {
    if (kind === 'embedding' || kind === 'mlp') return `M${-r},${-r}h${2 * r}v${2 * r}h${-2 * r}z`;
    if (kind === 'error') return `M0,${-r}L${r},0L0,${r}L${-r},0z`;
    if (kind === 'group') {
      const w = r * 1.3;
      return `M${-w},${-r}h${2 * w}v${2 * r}h${-2 * w}z`;
    }
    if (kind === 'logit') return `M0,${-r * 1.15}L${r},${r * 0.75}L${-r},${r * 0.75}z`;
    return `M${-r},0a${r},${r} 0 1,0 ${2 * r},0a${r},${r} 0 1,0 ${-2 * r},0`;
  }

  function itemName(i) {
    if (i >= N) return groups[i - N].name;
    if (nodes.kind[i] === 'feature') return nodes.label[i] || nodes.name[i];
    return nodes.kind[i] === 'embedding' ? visible(nodes.name[i]) : nodes.name[i];
  }

  function itemTitle(i) {
    if (i >= N) return `supernode "${groups[i - N].name}" (${groups[i - N].members.length} nodes)`;
    const kind = nodes.kind[i];
    const where = isCircuit ? nodes.token[i] : `position ${nodes.col[i]} (${JSON.stringify(nodes.token[i])})`;
    if (kind === 'feature') return `feature ${nodes.feature[i]} of layer ${nodes.layer[i]}, ${where}`;
    if (kind === 'error') return `error node of layer ${nodes.layer[i]}, ${where}`;
    if (kind === 'embedding') {
      return isCircuit ? `embeddings, ${where}` : `token ${JSON.stringify(nodes.token[i])} at position ${nodes.col[i]}`;
    }
    if (kind === 'logit') return isCircuit ? `logits, ${where}` : `answer logit ${nodes.name[i]}`;
    if (kind === 'head') return `head ${nodes.feature[i]} of layer ${nodes.layer[i]}, ${where}`;
    if (kind === 'mlp') return `MLP of layer ${nodes.layer[i]}, ${where}`;
    return nodes.id[i];
  }

  // ---- render: what the slider and the supernodes show, then laid out and drawn ------------------
  let cells = [];  // the drawn items by (row, col) cell, each list in the data's node order
  const laidOut = new Map();  // cell -> what it held when last laid out
  let axesSize = [0, 0];
  let maxInfluence = 0;  // node sizes are shares of the most influential source's influence
  for (let i = 0; influence && i < N; i++) {
    if (nodes.kind[i] !== 'logit') maxInfluence = Math.max(maxInfluence, influence[i] || 0);
  }

  function render() {
    const k = Number(slider.value);
    // which items are drawn, and their cells (in the data's node order; a supernode sits at its first
    // member's place)
    const byCell = new Map();
    const groupFirst = new Int32Array(G).fill(-1);
    const nextShown = new Uint8Array(items);
    for (let i = 0; i < N; i++) {
      if (!(nodeRank[i] < k)) { rep[i] = -1; continue; }
      const g = groupOf[i];
      let item = i;
      if (g >= 0 && collapsed[g]) {
        item = N + g;
        if (groupFirst[g] < 0) groupFirst[g] = i; else { rep[i] = item; continue; }
      }
      rep[i] = item;
      nextShown[item] = 1;
      const key = nodes.row[i] * 100003 + nodes.col[i];
      if (!byCell.has(key)) byCell.set(key, { r: nodes.row[i], c: nodes.col[i], list: [] });
      byCell.get(key).list.push(item);
    }
    cells = Array.from(byCell.values());
    for (let i = 0; i < items; i++) {
      if (nextShown[i] !== shown[i]) itemEl[i].classList.toggle('hidden', !nextShown[i]);
      shown[i] = nextShown[i];
    }
    // the links among drawn items: the slider's prefix, mapped onto supernodes (summed there); past
    // maxDrawn of them, the strongest maxDrawn (what a software-rendered canvas draws in a frame)
    const n = visibleLinkCount(k);
    const limited = n > maxDrawn;
    const room = Math.min(n, maxDrawn);
    if (drawnA.length < room) {
      drawnA = new Int32Array(room); drawnB = new Int32Array(room); drawnW = new Float64Array(room);
    }
    drawnC = [];
    let count = 0;
    const merged = new Map();
    const order = limited ? strongOrder : linkOrder;
    const end = limited ? E : n;
    for (let o = 0; o < end; o++) {
      const e = order[o];
      if (limited && !(linkRank[e] < k)) continue;
      const a = rep[SRC[e]], b = rep[DST[e]];
      if (a < 0 || b < 0 || a === b) continue;
      const onGroup = a >= N || b >= N;
      const key = onGroup ? a * (items + 1) + b : -1;
      if (onGroup && merged.has(key)) { drawnW[merged.get(key)] += WEIGHT[e]; continue; }
      if (count === room) { if (merged.size) continue; else break; }  // full: only sums onto supernodes go on
      if (onGroup) merged.set(key, count);
      drawnA[count] = a; drawnB[count] = b; drawnW[count] = WEIGHT[e];
      if (CHANNEL) drawnC[count] = onGroup ? '' : CHANNEL[e];
      count++;
    }
    linksLimited = limited ? n : 0;
    drawnCount = count;
    updateSliderText(k);
    layout();
    if (hovered >= 0 && shown[hovered]) highlight(hovered); else clearHover();
    drawLinks();
    if (selected >= 0) itemEl[selected].classList.add('selected');
  }

  const written = Array.from({ length: 3 }, () => new Array(items));  // attribute values last written
  function setAttr(item, slot, element, name, value) {
    if (written[slot][item] !== value) { element.setAttribute(name, value); written[slot][item] = value; }
  }

  // positions from the stage's size (kept up to date by a ResizeObserver: the header's text, set
  // just before, can change it)
  function layout() {
    if (!width) { width = stage.clientWidth; height = stage.clientHeight; }  // the first time only
    bandH = (height - MARGIN.top - MARGIN.bottom) / R;
    colW = (width - MARGIN.left - MARGIN.right) / C;
    for (const cell of cells) {
      // a cell whose items and size are as last time is as it was drawn (a drag changes a few cells)
      const signature = `${width}x${height}:${cell.list.join(',')}`;
      const key = cell.r * 100003 + cell.c;
      if (laidOut.get(key) === signature) continue;
      laidOut.set(key, signature);
      const m = cell.list.length;
      const cw = colW * 0.92, ch = bandH * 0.82;
      // one row while nodes can stand 18 px apart, else a block of rows
      let s = cw / m >= 18 ? Math.min(30, cw / m) : Math.min(30, Math.sqrt((cw * ch) / m));
      const perRow = Math.max(1, Math.min(m, Math.floor(cw / s)));
      const nRows = Math.ceil(m / perRow);
      s = Math.min(s, cw / perRow);
      const sy = Math.min(s, ch / nRows);
      const cx = colX(cell.c), cy = rowY(cell.r);
      cell.list.forEach((item, j) => {
        const row = Math.floor(j / perRow), inRow = j % perRow;
        const inThisRow = Math.min(perRow, m - row * perRow);
        px[item] = cx + (inRow - (inThisRow - 1) / 2) * s;
        py[item] = cy + ((nRows - 1) / 2 - row) * sy;
        const kind = item >= N ? 'group' : nodes.kind[item];
        let r;
        if (item >= N) r = Math.max(5, Math.min(10, 0.36 * s));
        else if (kind === 'logit') r = Math.min(8, 0.45 * s);
        else if (isCircuit || !influence) r = Math.min(7, 0.45 * s);
        else {
          const share = maxInfluence > 0 ? Math.max(0, influence[item] || 0) / maxInfluence : 0;
          r = Math.min(0.45 * s, 2.2 + 7 * Math.sqrt(share));
        }
        if (kind === 'error') r *= 0.85;
        pr[item] = Math.max(1.2, r);
        setAttr(item, 0, itemEl[item], 'transform', `translate(${px[item].toFixed(1)},${py[item].toFixed(1)})`);
        setAttr(item, 1, shapeEl[item], 'd', shapePath(kind, Number(pr[item].toFixed(2))));
        // a name where it fits between its neighbours (about 6.5 px a character); supernodes' and
        // logits' always, labels shortened; embeddings have theirs along the bottom, error nodes none
        let name = kind === 'embedding' || kind === 'error' ? '' : itemName(item);
        if (item >= N) name += ` (${groups[item - N].members.length})`;
        const always = item >= N || kind === 'logit';
        const room = inThisRow > 1 ? Math.min(cw, (item >= N ? 2.4 : 1) * s) : cw;  // to the neighbours, or the cell
        const chars = Math.floor((room - 4) / 6.5);
        const shortened = always || (chars >= 5 && item < N && nodes.label[item]);  // never a number cut short
        const text = name.length <= chars ? name : shortened ? name.slice(0, Math.max(5, chars) - 1) + '…' : '';
        if (textEl[item].textContent !== text) textEl[item].textContent = text;
        setAttr(item, 2, textEl[item], 'y', (pr[item] + 10).toFixed(1));
      });
    }
    if (width !== axesSize[0] || height !== axesSize[1]) { drawAxes(); axesSize = [width, height]; }
  }

  function updateSliderText(k) {
    let text;
    if (isCircuit) {
      text = `${k.toLocaleString()} of ${data.slider.count.toLocaleString()} edges` +
        (k > 0 ? ` · smallest |score| ${fmt(smallest[k - 1])}` : '');
    } else {
      const share = data.slider.cumulative ? data.slider.cumulative[k] : null;
      text = `${k.toLocaleString()} of ${data.slider.count.toLocaleString()} source nodes` +
        (share !== null ? ` · ${(100 * share).toFixed(1)}% of their influence` : '');
    }
    let drawnNodes = 0;
    for (let i = 0; i < items; i++) drawnNodes += shown[i];
    const linkText = linksLimited
      ? `the strongest ${drawnCount.toLocaleString()} of ${linksLimited.toLocaleString()} links`
      : `${drawnCount.toLocaleString()} links`;
    sliderText.textContent = `${text} · ${drawnNodes.toLocaleString()} nodes and ${linkText} drawn` +
      (k === data.slider.default ? (isCircuit ? ' (the kept circuit)' : ' (the pruned graph)') : '');
  }

  // ---- links on the canvas ------------------------------------------------------------------------
  const BUCKETS = 8;
  function drawLinks() {
    const dpr = window.devicePixelRatio || 1;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
      canvas.style.width = `${width}px`; canvas.style.height = `${height}px`;
    }
    const ctx = canvas.getContext('2d');
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.setTransform(dpr * zoom.s, 0, 0, dpr * zoom.s, dpr * zoom.x, dpr * zoom.y);
    let max = 0;
    for (let j = 0; j < drawnCount; j++) max = Math.max(max, Math.abs(drawnW[j]));
    if (max === 0) max = 1;
    // one path per (state, sign, width bucket): a few strokes whatever the number of links
    const paths = new Map();
    for (let j = 0; j < drawnCount; j++) {
      const w = drawnW[j];
      const bucket = Math.min(BUCKETS - 1, Math.floor((Math.abs(w) / max) * BUCKETS));
      const state = linkState ? linkState[j] : 0;
      const key = (state * 2 + (w >= 0 ? 0 : 1)) * BUCKETS + bucket;
      let list = paths.get(key);
      if (!list) { list = []; paths.set(key, list); }
      list.push(j);
    }
    const keys = Array.from(paths.keys()).sort((a, b) => {  // dimmed first, then by width
      const sa = Math.floor(a / (2 * BUCKETS)), sb = Math.floor(b / (2 * BUCKETS));
      return (sa === 1 ? -1 : sa) - (sb === 1 ? -1 : sb) || (a % BUCKETS) - (b % BUCKETS);
    });
    for (const key of keys) {
      const bucket = key % BUCKETS, negative = Math.floor(key / BUCKETS) % 2, state = Math.floor(key / (2 * BUCKETS));
      ctx.strokeStyle = negative ? NEGATIVE : POSITIVE;
      ctx.globalAlpha = state === 1 ? 0.06 : state === 2 ? 0.9 : 0.5;
      ctx.lineWidth = (0.4 + 4.6 * (bucket / (BUCKETS - 1)) ** 1.5) / zoom.s * Math.min(zoom.s, 3);
      ctx.beginPath();
      for (const j of paths.get(key)) {
        const a = drawnA[j], b = drawnB[j];
        const x0 = px[a], y0 = py[a], x1 = px[b], y1 = py[b];
        ctx.moveTo(x0, y0);
        const channel = CHANNEL ? drawnC[j] : '';
        const bend = channel === 'k' ? 0.18 : channel === 'v' ? -0.18 : 0;
        if (bend !== 0 || Math.abs(y1 - y0) < 1) {  // a head's k and v inputs curve apart; same-row links arch
          const mx = (x0 + x1) / 2, my = (y0 + y1) / 2;
          const dx = x1 - x0, dy = y1 - y0;
          const lift = Math.abs(y1 - y0) < 1 ? -0.35 * bandH : 0;
          ctx.quadraticCurveTo(mx - dy * bend, my + dx * bend + lift, x1, y1);
        } else {
          ctx.lineTo(x1, y1);
        }
      }
      ctx.stroke();
    }
    ctx.globalAlpha = 1;
  }

  // ---- hover: the paths from the inputs to the answer through a node ------------------------------
  function highlight(item) {
    const up = new Map(), down = new Map();  // item -> drawn links into it / out of it
    for (let j = 0; j < drawnCount; j++) {
      if (!down.has(drawnA[j])) down.set(drawnA[j], []);
      down.get(drawnA[j]).push(j);
      if (!up.has(drawnB[j])) up.set(drawnB[j], []);
      up.get(drawnB[j]).push(j);
    }
    linkState = new Uint8Array(drawnCount).fill(1);
    onPath = new Uint8Array(items);
    onPath[item] = 1;
    for (const [edges, end] of [[up, 'from'], [down, 'to']]) {  // ancestors, then descendants
      const seen = new Uint8Array(items);
      const stack = [item];
      seen[item] = 1;
      while (stack.length) {
        const at = stack.pop();
        for (const j of edges.get(at) || []) {
          linkState[j] = 2;
          const next = end === 'from' ? drawnA[j] : drawnB[j];
          if (!seen[next]) { seen[next] = 1; onPath[next] = 1; stack.push(next); }
        }
      }
    }
    for (let i = 0; i < items; i++) if (shown[i]) itemEl[i].classList.toggle('dim', !onPath[i]);
  }

  function clearHover() {
    hovered = -1;
    linkState = null;
    if (onPath) for (let i = 0; i < items; i++) itemEl[i].classList.remove('dim');
    onPath = null;
  }

  function setHover(item) {
    if (item < 0) clearHover(); else { hovered = item; highlight(item); }
    drawLinks();
  }

  // ---- the panel ----------------------------------------------------------------------------------
  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return '–';
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return Number(v.toPrecision(4)).toString();
  }
  const ENTITIES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ENTITIES[c]);

  function linkList(title, adj, i, other) {
    const from = adj.start[i], to = adj.start[i + 1];
    if (to === from) return `<h4>${title}</h4><p class="none">none in this page</p>`;
    const rows = [];
    for (let p = from; p < Math.min(to, from + 6); p++) {
      const e = adj.list[p];
      const j = other[e];
      const channel = CHANNEL ? ` <span class="channel">${esc(CHANNEL[e])}</span>` : '';
      const where = isCircuit ? (data.columns.length > 1 ? ` @${esc(nodes.token[j])}` : '')
        : (nodes.kind[j] === 'logit' ? '' : ` @${nodes.col[j]}`);
      const layer = nodes.kind[j] === 'feature' || nodes.kind[j] === 'error' ? `L${nodes.layer[j]} ` : '';
      rows.push(`<li><a href="#" data-node="${j}">${esc(layer + itemName(j))}${where}</a>${channel}` +
        `<span class="w ${WEIGHT[e] >= 0 ? 'pos' : 'neg'}">${fmt(WEIGHT[e])}</span></li>`);
    }
    const more = to - from > 6 ? `<p class="none">and ${to - from - 6} more</p>` : '';
    return `<h4>${title} (${to - from})</h4><ol class="links">${rows.join('')}</ol>${more}`;
  }

  function showPanel(item) {
    if (!inputs) { inputs = adjacency(DST); outputs = adjacency(SRC); }
    let html = '';
    if (item >= N) {
      const g = groups[item - N];
      html += `<h3>${esc(g.name)}</h3><p class="kind">supernode of ${g.members.length} nodes</p>`;
      html += `<button type="button" data-expand="${item - N}">${collapsed[item - N] ? 'expand' : 'collapse'}</button>`;
      html += '<ol class="links">' + g.members.map((m) => `<li><a href="#" data-node="${m}">${esc(nodes.id[m])}</a>` +
        (influence ? `<span class="w">${fmt(influence[m])}</span>` : '') + '</li>').join('') + '</ol>';
    } else {
      const i = item, kind = nodes.kind[i];
      const head = kind === 'feature' ? `L${nodes.layer[i]} #${nodes.feature[i]}` : itemName(i);
      html += `<h3>${esc(head)}</h3><p class="kind">${esc(itemTitle(i))}</p>`;
      if (nodes.label[i]) html += `<p class="label">${esc(nodes.label[i])}</p>`;
      const value = (field) => (nodes[field] && nodes[field][i] !== null && nodes[field][i] !== undefined
        ? nodes[field][i] : null);
      const rows = [['id', nodes.id[i]]];
      const measured = kind === 'error' ? 'norm' : kind === 'logit' ? 'logit (demeaned)' : 'activation';
      if (value('activation') !== null) rows.push([measured, fmt(value('activation'))]);
      if (value('influence') !== null) rows.push(['influence', fmt(value('influence'))]);
      if (value('rank') !== null && value('rank') >= 0) {
        rows.push(['rank by influence', `${value('rank') + 1} of ${data.slider.count}`]);
      }
      if (value('probability') !== null) rows.push(['probability', fmt(value('probability'))]);
      const g = groupOf[i];
      if (g >= 0) rows.push(['supernode', groups[g].name]);
      html += '<table>' + rows.map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(v)}</td></tr>`).join('') + '</table>';
      if (g >= 0) html += `<button type="button" data-expand="${g}">collapse "${esc(groups[g].name)}"</button>`;
      if (value('grid') !== null && value('grid') >= 0) {
        html += '<div class="grid"><h4>Operand plot</h4><canvas class="heatmap"></canvas>'
          + '<p class="grid-value"></p></div>';
      }
      html += linkList('Top inputs', inputs, i, SRC) + linkList('Top outputs', outputs, i, DST);
    }
    panel.innerHTML = html;
    if (item < N && nodes.grid && nodes.grid[item] >= 0) drawGrid(data.grids[nodes.grid[item]]);
  }

  panel.addEventListener('click', (event) => {
    const target = event.target.closest('[data-node],[data-expand]');
    if (!target) return;
    event.preventDefault();
    if (target.dataset.expand !== undefined) {
      const g = Number(target.dataset.expand);
      collapsed[g] = collapsed[g] ? 0 : 1;
      const focus = collapsed[g] ? N + g : groups[g].members[0];
      render();
      select(focus);
      return;
    }
    const i = Number(target.dataset.node);
    const g = groupOf[i];
    if (g >= 0 && collapsed[g]) { collapsed[g] = 0; render(); }
    select(i);
  });

  // the operand plot: the feature's activation over a (rows, top to bottom) × b (columns)
  function drawGrid(grid) {
    const box = panel.querySelector('canvas.heatmap');
    const caption = panel.querySelector('.grid-value');
    const nA = grid.a.length, nB = grid.b.length;
    const bytes = Uint8Array.from(atob(grid.values), (c) => c.charCodeAt(0));
    const left = 30, bottom = 18, size = 200;
    box.width = left + size + 6; box.height = size + bottom + 4;
    const ctx = box.getContext('2d');
    const image = ctx.createImageData(nB, nA);
    const low = [247, 251, 255], high = [8, 48, 107];
    for (let p = 0; p < nA * nB; p++) {
      const q = bytes[p];
      const c = q === 255 ? [220, 220, 220] : low.map((l, j) => Math.round(l + ((high[j] - l) * q) / 254));
      image.data.set([c[0], c[1], c[2], 255], 4 * p);
    }
    const off = document.createElement('canvas');
    off.width = nB; off.height = nA;
    off.getContext('2d').putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, left, 2, size, size);
    ctx.strokeStyle = '#999'; ctx.strokeRect(left - 0.5, 1.5, size + 1, size + 1);
    ctx.fillStyle = '#555'; ctx.font = '10px sans-serif';
    ctx.textAlign = 'right'; ctx.textBaseline = 'middle';
    ctx.fillText(`a ${grid.a[0]}`, left - 3, 8);
    ctx.fillText(String(grid.a[nA - 1]), left - 3, size - 4);
    ctx.textAlign = 'center'; ctx.textBaseline = 'top';
    ctx.fillText(`b ${grid.b[0]}`, left + 14, size + 5);
    ctx.fillText(String(grid.b[nB - 1]), left + size - 8, size + 5);
    const base = `${grid.title}: activation ${fmt(grid.lo)} (white) to ${fmt(grid.hi)} (dark blue); hover for values`;
    caption.textContent = base;
    box.addEventListener('mousemove', (event) => {
      const rect = box.getBoundingClientRect();
      const x = (event.clientX - rect.left) * (box.width / rect.width) - left;
      const y = (event.clientY - rect.top) * (box.height / rect.height) - 2;
      if (x < 0 || y < 0 || x >= size || y >= size) { caption.textContent = base; return; }
      const ia = Math.floor((y / size) * nA), ib = Math.floor((x / size) * nB);
      const q = bytes[ia * nB + ib];
      const value = q === 255 ? 'no value' : fmt(grid.lo + ((grid.hi - grid.lo) * q) / 254);
      caption.textContent = `a = ${grid.a[ia]}, b = ${grid.b[ib]}: activation ${value}`;
    });
    box.addEventListener('mouseleave', () => { caption.textContent = base; });
  }

  function select(item) {
    if (selected >= 0) itemEl[selected].classList.remove('selected');
    selected = item;
    if (item >= 0) { itemEl[item].classList.add('selected'); showPanel(item); }
  }

  // ---- events -------------------------------------------------------------------------------------
  slider.addEventListener('input', render);
  pruned.addEventListener('click', () => { slider.value = String(data.slider.default); render(); });
  if (expandAll) expandAll.addEventListener('click', () => { collapsed.fill(0); render(); });
  if (collapseAll) collapseAll.addEventListener('click', () => { collapsed.fill(1); render(); });
  resetView.addEventListener('click', () => { zoom = { s: 1, x: 0, y: 0 }; applyZoom(); });

  const itemOf = (target) => {
    const g = target.closest && target.closest('g.node');
    return g ? Number(g.dataset.item) : -1;
  };
  nodeLayer.addEventListener('click', (event) => {
    const item = itemOf(event.target);
    if (item < 0) return;
    if (item >= N) { collapsed[item - N] = 0; render(); }
    select(item);
  });
  nodeLayer.addEventListener('mouseover', (event) => {
    const item = itemOf(event.target);
    if (item < 0 || item === hovered) return;
    setHover(item);
    tooltip.textContent = itemTitle(item) + (item < N && nodes.label[item] ? ` · ${nodes.label[item]}` : '');
    tooltip.style.display = 'block';
  });
  nodeLayer.addEventListener('mouseout', (event) => {
    const to = itemOf(event.relatedTarget || document.body);
    if (to === hovered) return;
    tooltip.style.display = 'none';
    setHover(-1);
  });
  stage.addEventListener('mousemove', (event) => {
    if (tooltip.style.display !== 'block') return;
    const rect = stage.getBoundingClientRect();
    tooltip.style.left = `${event.clientX - rect.left + 12}px`;
    tooltip.style.top = `${event.clientY - rect.top + 12}px`;
  });

  function applyZoom() {
    viewport.setAttribute('transform', `translate(${zoom.x},${zoom.y}) scale(${zoom.s})`);
    drawLinks();
  }
  stage.addEventListener('wheel', (event) => {
    event.preventDefault();
    const rect = stage.getBoundingClientRect();
    const mx = event.clientX - rect.left, my = event.clientY - rect.top;
    const s = Math.min(40, Math.max(0.5, zoom.s * Math.exp(-event.deltaY * 0.0015)));
    zoom = { s, x: mx - ((mx - zoom.x) * s) / zoom.s, y: my - ((my - zoom.y) * s) / zoom.s };
    applyZoom();
  }, { passive: false });
  let drag = null;
  svg.addEventListener('pointerdown', (event) => {
    if (itemOf(event.target) >= 0) return;
    drag = { x: event.clientX, y: event.clientY, zx: zoom.x, zy: zoom.y };
    svg.setPointerCapture(event.pointerId);
  });
  svg.addEventListener('pointermove', (event) => {
    if (!drag) return;
    zoom = { s: zoom.s, x: drag.zx + event.clientX - drag.x, y: drag.zy + event.clientY - drag.y };
    applyZoom();
  });
  svg.addEventListener('pointerup', () => { drag = null; });
  new ResizeObserver((entries) => {  // the size comes with the event: reading it would force a layout
    const size = entries[entries.length - 1].contentRect;
    if (size.width !== width || size.height !== height) {
      width = size.width; height = size.height;
      layout(); drawLinks();
    }
  }).observe(stage);

  // ---- what scripts and tests read -----------------------------------------------------------------
  const itemIndex = new Map();
  for (let i = 0; i < items; i++) itemIndex.set(itemEl[i].dataset.id, i);
  const find = (id) => {
    if (!itemIndex.has(id)) throw new Error(`no node ${id}`);
    return itemIndex.get(id);
  };
  const groupIndex = (name) => {
    const j = groups.findIndex((g) => g.name === name);
    if (j < 0) throw new Error(`no supernode ${name}`);
    return j;
  };
  window.graphView = {
    data,
    drawnNodes: () => Array.from(nodeLayer.querySelectorAll('g.node:not(.hidden)'), (g) => g.dataset.id),
    drawnLinks: () => Array.from({ length: drawnCount }, (_, j) => [itemEl[drawnA[j]].dataset.id,
      itemEl[drawnB[j]].dataset.id, drawnW[j], ...(CHANNEL ? [drawnC[j]] : [])]),
    highlightedLinks: () => Array.from({ length: linkState ? drawnCount : 0 }, (_, j) => j)
      .filter((j) => linkState[j] === 2).map((j) => [itemEl[drawnA[j]].dataset.id, itemEl[drawnB[j]].dataset.id]),
    setSlider: (k) => { slider.value = String(k); render(); },
    select: (id) => {
      const item = find(id);
      if (item < N && groupOf[item] >= 0 && collapsed[groupOf[item]]) { collapsed[groupOf[item]] = 0; render(); }
      select(item);
    },
    hover: (id) => setHover(id === null ? -1 : find(id)),
    expand: (name) => { collapsed[groupIndex(name)] = 0; render(); },
    collapse: (name) => { collapsed[groupIndex(name)] = 1; render(); },
  };
  render();
  window.graphView.readyMs = performance.now();
  document.documentElement.dataset.ready = 'true';
})();
