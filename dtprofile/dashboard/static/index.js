// The dtprofile tab: the verdict, the step per rank, scaling and what-ifs for one run.
// Plain JavaScript and SVG, loaded by TensorBoard in an iframe whose base URL is
// /data/plugin/dtprofile/: "./runs" and the other requests reach the plugin's routes.
// Nothing is fetched from anywhere else (TensorBoard runs offline).

const PART_COLORS = {
  data_wait: '#e8a33d', forward: '#4c78a8', backward: '#72b7b2', optimizer: '#54a24b',
  other: '#a0a0a0', comm_exposed: '#e45756', comm_peer_wait: '#b279a2', comm_interference: '#ff9da6',
};
const CURVES = [
  {key: 'linear', label: 'linear', color: '#999999', dash: '6 4'},
  {key: 'alpha', label: "paper's α (Amdahl)", color: '#f58518', dash: ''},
  {key: 'refined', label: "dtprofile's refined model", color: '#4c78a8', dash: ''},
];
const SVG = 'http://www.w3.org/2000/svg';

// The charts size themselves to their container: each drawing is kept, by its holder's
// id, and drawn again when the window's width changes (TensorBoard may create the tab's
// frame narrower than it ends up).
const drawings = new Map();
function draw(holder, fn) {
  drawings.set(holder.id, () => { if (holder.isConnected) fn(); });
  fn();
}
let resizeTimer = null;
window.addEventListener('resize', () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => { for (const redraw of drawings.values()) redraw(); }, 150);
});

const STYLE = `
:root { --fg: #212121; --muted: #616161; --bg: #ffffff; --card: #f7f7f7; --line: #dddddd;
        --bad: #c62828; --warn: #ef6c00; --ok: #2e7d32; --accent: #1976d2; color-scheme: light; }
body.dark { --fg: #e8e8e8; --muted: #a8a8a8; --bg: #202124; --card: #2b2c2f; --line: #45474a;
            --bad: #ef9a9a; --warn: #ffb74d; --ok: #a5d6a7; --accent: #90caf9; color-scheme: dark; }
body { margin: 0; background: var(--bg); color: var(--fg);
       font: 14px/1.45 Roboto, 'Helvetica Neue', Arial, sans-serif; }
.dtp { max-width: 1200px; margin: 0 auto; padding: 16px; box-sizing: border-box; }
.dtp h2 { font-size: 16px; margin: 22px 0 8px; }
.dtp header { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; }
.dtp select, .dtp input, .dtp button { font: inherit; color: var(--fg); background: var(--card);
       border: 1px solid var(--line); border-radius: 4px; padding: 4px 6px; }
.dtp button { cursor: pointer; }
.caption, .muted { color: var(--muted); font-size: 13px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 12px 14px; }
.verdict { border-left: 6px solid var(--accent); }
.verdict.high, .verdict.critical { border-left-color: var(--bad); }
.verdict.medium { border-left-color: var(--warn); }
.verdict.low, .verdict.info { border-left-color: var(--ok); }
.verdict .title { font-size: 17px; font-weight: 600; margin: 4px 0; }
.badge { display: inline-block; font-size: 11px; font-weight: 700; letter-spacing: .04em; padding: 1px 6px;
         border-radius: 3px; background: var(--line); text-transform: uppercase; }
.field { margin: 4px 0; } .field b { color: var(--muted); font-weight: 600; margin-right: 4px; }
details { margin: 6px 0; } summary { cursor: pointer; }
.grid { display: flex; flex-wrap: wrap; gap: 16px; } .grid > * { flex: 1 1 360px; min-width: 0; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; margin: 4px 0; }
.legend span::before { content: ''; display: inline-block; width: 10px; height: 10px; margin-right: 5px;
                       background: var(--swatch); vertical-align: -1px; }
svg text { fill: var(--fg); font-size: 11px; } svg .axis { stroke: var(--line); }
svg .straggler { fill: var(--bad); font-weight: 700; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 3px 10px; text-align: right;
        border-bottom: 1px solid var(--line); } th:first-child, td:first-child { text-align: left; }
.error { color: var(--bad); margin: 6px 0; }
form.whatif { display: flex; flex-wrap: wrap; gap: 8px 14px; align-items: end; }
form.whatif label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
form.whatif input { width: 110px; }
`;

// ----------------------------------------------------------------------------- helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === 'class') node.className = v; else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, v);
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
  return node;
}

// replaceChildren without the absent parts (a null would show as the text "null").
function put(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}

function titled(node, text) { node.append(svg('title', {}, text)); return node; }

function num(v, digits = 3) {
  if (v === null || v === undefined || !Number.isFinite(v)) return '–';
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toString();
}
const ms = (v) => (v === null || v === undefined ? '–' : `${num(v)} ms`);
const pct = (v) => (v === null || v === undefined ? '–' : `${(100 * v).toFixed(1)}%`);

async function getJSON(url) {
  let response;
  try { response = await fetch(url); } catch (e) { throw new Error(`cannot reach TensorBoard (${e.message})`); }
  let body;
  try { body = await response.json(); } catch (e) { throw new Error(`${url}: the answer is not JSON (status ${response.status})`); }
  if (!response.ok || (body && body.error)) throw new Error(body && body.error ? body.error : `status ${response.status}`);
  return body;
}

function width(node, fallback = 720) { return Math.max(320, Math.floor(node.clientWidth || fallback)); }

// TensorBoard's theme lives on the parent page (same origin); follow it, else the system's.
function followTheme() {
  const apply = () => {
    let dark = window.matchMedia && window.matchMedia('(prefers-color-scheme: dark)').matches;
    try {
      const parent = window.parent && window.parent.document && window.parent.document.body;
      if (parent && parent !== document.body) dark = parent.classList.contains('dark-mode');
      if (parent && parent !== document.body && !followTheme.observing) {
        new MutationObserver(apply).observe(parent, {attributes: true, attributeFilter: ['class']});
        followTheme.observing = true;
      }
    } catch (e) { /* another origin: the system's preference */ }
    document.body.classList.toggle('dark', !!dark);
  };
  apply();
}

// ----------------------------------------------------------------------------- the page
export async function render() {
  document.head.append(el('style', {}, STYLE));
  followTheme();
  const runSelect = el('select', {id: 'run', 'aria-label': 'run'});
  const compareSelect = el('select', {id: 'compare', 'aria-label': 'compare with'});
  const status = el('div', {class: 'error', id: 'status'});
  const body = el('div', {id: 'body'});
  const root = el('div', {class: 'dtp'},
    el('header', {}, el('b', {}, 'dtprofile'), el('label', {}, 'run ', runSelect),
      el('label', {}, 'compare with ', compareSelect)),
    status, body);
  document.body.append(root);
  let index;
  try { index = await getJSON('./runs'); } catch (e) { status.textContent = e.message; return; }
  if (!index.runs.length) {
    status.textContent = 'No dtprofile run under this log directory' +
      (index.errors.length ? `: ${index.errors.join('; ')}` : ' (a run writes dtprofile_summary.json when it ends).');
    return;
  }
  if (index.errors.length) status.textContent = `Not read: ${index.errors.join('; ')}`;
  for (const r of index.runs) runSelect.append(el('option', {value: r.run, title: r.caption}, r.run));
  compareSelect.append(el('option', {value: ''}, '—'));
  for (const r of index.runs) compareSelect.append(el('option', {value: r.run}, r.run));
  const show = () => showRun(body, runSelect.value, compareSelect.value);
  runSelect.addEventListener('change', show);
  compareSelect.addEventListener('change', show);
  await show();
}

let shown = 0;  // the newest choice: an older answer that comes later is dropped
async function showRun(body, run, other) {
  const mine = ++shown;
  put(body, el('p', {class: 'muted'}, `Loading ${run}…`));
  let view;
  try { view = await getJSON(`./run?run=${encodeURIComponent(run)}`); } catch (e) {
    if (mine === shown) put(body, el('div', {class: 'error'}, `${run}: ${e.message}`));
    return;
  }
  if (mine !== shown) return;
  drawings.clear();
  const scaling = el('div', {id: 'scaling'});
  put(body, 
    el('div', {class: 'caption'}, view.caption || ''),
    verdictSection(view),
    el('h2', {}, 'The step'), stepSection(view),
    ...(view.pipeline ? [el('h2', {}, 'Pipeline'), pipelineSection(view.pipeline)] : []),
    el('h2', {}, 'Scaling'), scaling,
    el('h2', {}, 'What if'), whatIfSection(view, scaling),
    el('h2', {}, 'Over time'), overTimeSection(view),
    ...(other ? [el('h2', {}, `Compared with ${other}`), compareSection(run, other)] : []),
  );
  draw(scaling, () => drawScaling(scaling, view.scaling));
}

// ----------------------------------------------------------------------------- verdict
function findingFields(f) {
  return [
    f.evidence ? el('div', {class: 'field'}, el('b', {}, 'Evidence'), f.evidence) : null,
    f.action ? el('div', {class: 'field'}, el('b', {}, 'Action'), f.action) : null,
    f.gain ? el('div', {class: 'field'}, el('b', {}, 'Expected gain'), f.gain) : null,
  ];
}

function verdictSection(view) {
  const v = view.verdict;
  if (!v) return el('div', {class: 'card verdict', id: 'verdict'}, 'No findings in this run.');
  const others = view.findings.map((f) => el('details', {class: 'finding'},
    el('summary', {}, el('span', {class: 'badge'}, f.severity), ' ', f.title, el('span', {class: 'muted'}, ` [${f.id}]`)),
    el('div', {class: 'card'}, findingFields(f))));
  return el('div', {},
    el('div', {class: `card verdict ${v.severity}`, id: 'verdict'},
      el('span', {class: 'badge'}, v.severity), el('span', {class: 'muted'}, ` ${v.id}`),
      el('div', {class: 'title'}, v.title), findingFields(v)),
    others.length ? el('details', {id: 'other-findings'},
      el('summary', {}, `${others.length} other finding${others.length > 1 ? 's' : ''}`), others) : null);
}

// ----------------------------------------------------------------------------- the step
function stepSection(view) {
  const step = view.step;
  const rows = [{label: 'median rank', parts: step.parts, step: step.step_ms}];
  if (step.ranks.length > 1) for (const r of step.ranks) rows.push({label: `rank ${r.rank}`, parts: r.parts, step: r.step_ms, straggler: r.straggler});
  const holder = el('div', {id: 'step-bars'});
  const keys = new Map();
  for (const r of rows) for (const p of r.parts) keys.set(p.key, p.label);
  const legend = el('div', {class: 'legend'},
    [...keys].map(([k, label]) => el('span', {style: `--swatch:${PART_COLORS[k] || '#777'}`}, label)));
  requestAnimationFrame(() => draw(holder, () => drawBars(holder, rows)));
  // Many ranks: a bar each for the slowest and the fastest; the rest as a distribution.
  const spread = step.ranks_total ? el('div', {id: 'rank-spread'},
    el('p', {class: 'muted'}, `${step.ranks.length} of ${step.ranks_total} ranks shown: the slowest and the fastest`),
    el('ul', {}, (step.spread || []).map((line) => el('li', {}, line)))) : null;
  return el('div', {class: 'grid'}, el('div', {}, legend, holder, spread), commPanel(view.comm, view.ratios));
}

function drawBars(holder, rows) {
  const w = width(holder), labelW = 150, rightW = 70, rowH = 24;
  const max = Math.max(1e-9, ...rows.map((r) => r.parts.reduce((s, p) => s + (p.ms || 0), 0)));
  const scale = (w - labelW - rightW) / max;
  const g = svg('svg', {width: w, height: rows.length * rowH + 8, role: 'img', 'aria-label': 'step parts per rank'});
  rows.forEach((r, i) => {
    const y = 4 + i * rowH;
    g.append(svg('text', {x: 0, y: y + 15, class: r.straggler ? 'straggler' : null},
      r.straggler ? `${r.label} ⚠ straggler` : r.label));
    let x = labelW;
    for (const p of r.parts) {
      const len = (p.ms || 0) * scale;
      if (len <= 0) continue;
      g.append(titled(svg('rect', {x, y: y + 3, width: Math.max(len, 0.5), height: rowH - 8, fill: PART_COLORS[p.key] || '#777',
        class: 'bar', 'data-part': p.key}), `${r.label}: ${p.label} ${ms(p.ms)}`));
      x += len;
    }
    g.append(svg('text', {x: x + 6, y: y + 15}, ms(r.step)));
  });
  put(holder, g);
}

function commPanel(comm, ratios) {
  const rows = [];
  const add = (label, value) => rows.push(el('tr', {}, el('td', {}, label), el('td', {}, value)));
  if (comm.total_ms === null && comm.exposed_ms === null) {
    return el('div', {class: 'card', id: 'comm'}, el('b', {}, 'Communication'),
      el('p', {class: 'muted'}, comm.unmeasured || 'not measured (one process, or no DDP/FSDP model)'));
  }
  add('total per step', ms(comm.total_ms));
  add('exposed (after backward)', ms(comm.exposed_ms));
  add('hidden under compute', pct(comm.overlap));
  add('gradients per step', comm.grad_MB === null ? '–' : `${num(comm.grad_MB)} MB`);
  add('bus bandwidth', comm.busbw_GBps === null ? '–' : `${num(comm.busbw_GBps)} GB/s (${num(8 * comm.busbw_GBps)} Gbit/s)`);
  add(`link (${comm.link_source || '–'})`, comm.link_GBps === null ? '–' : `${num(comm.link_GBps)} GB/s (${num(8 * comm.link_GBps)} Gbit/s)`);
  if (ratios && ratios.R_O !== undefined) add('R_O = T_O / T_C', num(ratios.R_O));
  const bar = el('div', {});
  if (comm.total_ms) {
    const hidden = Math.max(0, comm.total_ms - (comm.exposed_ms || 0));
    const g = svg('svg', {width: 300, height: 18, role: 'img', 'aria-label': 'communication hidden and exposed'});
    const s = 300 / Math.max(comm.total_ms, comm.exposed_ms || 0);
    g.append(titled(svg('rect', {x: 0, y: 2, width: hidden * s, height: 14, fill: '#72b7b2'}), `hidden ${ms(hidden)}`));
    g.append(titled(svg('rect', {x: hidden * s, y: 2, width: (comm.exposed_ms || 0) * s, height: 14, fill: PART_COLORS.comm_exposed}),
      `exposed ${ms(comm.exposed_ms)}`));
    bar.append(g, el('div', {class: 'legend'}, el('span', {style: '--swatch:#72b7b2'}, 'hidden'),
      el('span', {style: `--swatch:${PART_COLORS.comm_exposed}`}, 'exposed')));
  }
  // A DeviceMesh: each dimension's collectives per step (tensor parallel, FSDP2 on the other).
  const mesh = (comm.by_dim || []).length ? el('div', {id: 'comm-by-dim'},
    el('p', {class: 'muted'}, `per mesh dimension (${comm.mesh || 'mesh'}):`),
    el('ul', {}, comm.by_dim.map((line) => el('li', {}, line)))) : null;
  return el('div', {class: 'card', id: 'comm'}, el('b', {}, 'Communication'), bar, el('table', {}, rows), mesh);
}

// ----------------------------------------------------------------------------- pipeline
// Each stage's step split into its forward, its backward and its waits for a neighbour
// (the bubble): how long each is. Below it, one step as the stages ran it: each forward,
// backward, wait and update where it fell in the step, a row a stage.
const TIMELINE_COLORS = {F: PART_COLORS.forward, B: PART_COLORS.backward, R: PART_COLORS.comm_exposed,
  S: PART_COLORS.comm_peer_wait, U: PART_COLORS.optimizer};
const TIMELINE_LABELS = {F: 'forward', B: 'backward', R: 'waiting for a neighbour', S: 'sending', U: 'update'};

function pipelineSection(p) {
  const most = Math.max(1e-9, ...p.stages.map((s) => (s.forward_ms || 0) + (s.backward_ms || 0) + (s.wait_ms || 0)));
  const scale = 420 / most, rows = svg('g');
  p.stages.forEach((s, i) => {
    let x = 70;
    const y = 6 + i * 22;
    rows.append(svg('text', {x: 0, y: y + 12}, s.label || `rank ${s.rank}`));
    for (const [key, label, color] of [['forward_ms', 'forward', PART_COLORS.forward],
      ['backward_ms', 'backward', PART_COLORS.backward], ['wait_ms', 'waits', PART_COLORS.comm_exposed]]) {
      const w = (s[key] || 0) * scale;
      rows.append(titled(svg('rect', {x, y, width: w, height: 16, fill: color}), `${label} ${ms(s[key])}`));
      x += w;
    }
  });
  const chart = svg('svg', {width: 500, height: 12 + 22 * p.stages.length, id: 'pipeline-stages'}, rows);
  return el('div', {class: 'card', id: 'pipeline'},
    el('ul', {}, p.lines.map((line) => el('li', {}, line))), chart,
    el('div', {class: 'legend'}, el('span', {style: `--swatch:${PART_COLORS.forward}`}, 'forward'),
      el('span', {style: `--swatch:${PART_COLORS.backward}`}, 'backward'),
      el('span', {style: `--swatch:${PART_COLORS.comm_exposed}`}, 'waits for a neighbour')),
    p.timeline ? pipelineTimeline(p.timeline) : null);
}

function pipelineTimeline(t) {
  const left = 130, width = 620, total = Math.max(1e-9, t.step_ms || 0), scale = (width - left - 10) / total;
  const rows = svg('g');
  t.stages.forEach((stage, i) => {
    const y = 6 + i * 22;
    rows.append(svg('text', {x: 0, y: y + 12}, stage.label));
    for (const [kind, start, end] of stage.events) {
      const x = left + start * scale, w = Math.max((end - start) * scale, 0.5);
      rows.append(titled(svg('rect', {x, y, width: w, height: 16, fill: TIMELINE_COLORS[kind] || '#777',
        class: `event-${kind}`}), `${TIMELINE_LABELS[kind] || kind} ${ms(start)} to ${ms(end)}`));
    }
  });
  const axisY = 10 + 22 * t.stages.length;
  rows.append(svg('line', {x1: left, x2: left + total * scale, y1: axisY, y2: axisY, stroke: '#999'}));
  rows.append(svg('text', {x: left, y: axisY + 14}, '0'));
  rows.append(svg('text', {x: left + total * scale - 40, y: axisY + 14}, ms(total)));
  const chart = svg('svg', {width, height: axisY + 20, id: 'pipeline-timeline'}, rows);
  return el('div', {id: 'pipeline-timeline-card'},
    el('p', {class: 'muted'}, `one step as the stages ran it (${t.caption}):`), chart,
    el('div', {class: 'legend'}, Object.entries(TIMELINE_LABELS).map(([k, label]) =>
      el('span', {style: `--swatch:${TIMELINE_COLORS[k]}`}, label))));
}

// ----------------------------------------------------------------------------- scaling
// Speedup on log-log axes (linear scaling is the diagonal) and efficiency on a linear
// axis, both against the GPU count on a log axis.
function drawScaling(holder, s) {
  if (!s || !s.gpus || !s.gpus.length) { put(holder, el('p', {class: 'muted'}, 'No projection in this run.')); return; }
  const half = Math.max(320, Math.floor((width(holder) - 16) / 2));
  const speedup = chart(s, half, {
    id: 'scaling-chart', label: 'speedup against GPU count', yLabel: 'speedup', log: true,
    value: (key, i) => s[key][i], measured: (p) => p.speedup,
    target: Number.isFinite(s.target_efficiency) ? (g) => s.target_efficiency * g : null,
  });
  const efficiency = chart(s, half, {
    id: 'efficiency-chart', label: 'efficiency against GPU count', yLabel: 'efficiency', log: false, percent: true,
    value: (key, i) => (key === 'linear' ? 1 : key === 'alpha' ? s.alpha_efficiency[i] : s.efficiency[i]),
    measured: (p) => p.efficiency,
    target: Number.isFinite(s.target_efficiency) ? () => s.target_efficiency : null,
  });
  const legend = el('div', {class: 'legend'},
    CURVES.map((c) => el('span', {style: `--swatch:${c.color}`}, c.label)),
    Number.isFinite(s.target_efficiency) ? el('span', {style: '--swatch:#54a24b'}, `target efficiency ${pct(s.target_efficiency)}`) : null,
    Number.isFinite(s.recommended_gpus) ? el('span', {style: '--swatch:#54a24b'}, `recommended: ${s.recommended_gpus} GPUs`
      + (s.recommended_gpus_range && s.recommended_gpus_range[0] !== s.recommended_gpus_range[1]
        ? ` (${s.recommended_gpus_range[0]}-${s.recommended_gpus_range[1]} within this run's noise)` : '')) : null,
    s.measured.length ? el('span', {style: '--swatch:transparent'}, '□ measured runs of this job') : null);
  // The run's own projection carries each efficiency's range within the run's noise.
  const ranges = Array.isArray(s.efficiency_range) && s.efficiency_range.length === s.gpus.length ? s.efficiency_range : null;
  const span = (r) => (Array.isArray(r) ? `${pct(r[0])}-${pct(r[1])}` : '-');
  const table = el('table', {id: 'scaling-table'},
    el('tr', {}, [s.axis || 'GPUs', 'speedup', 'efficiency', ...(ranges ? ['efficiency range'] : []), "paper's speedup",
      "paper's efficiency"].map((t) => el('th', {}, t))),
    s.gpus.map((gp, i) => el('tr', {}, el('td', {}, String(gp)), el('td', {}, num(s.refined[i])),
      el('td', {}, pct(s.efficiency[i])), ranges ? el('td', {class: 'range'}, span(ranges[i])) : null,
      el('td', {}, num(s.alpha[i])), el('td', {}, pct(s.alpha_efficiency[i])))));
  put(holder, el('div', {class: 'caption'}, s.caption || ''), legend,
    s.scaling_question ? el('p', {class: 'question'}, s.scaling_question) : null,
    el('div', {class: 'grid'}, speedup, efficiency), table);
}

function chart(s, w, o) {
  const h = 280, left = 52, right = 16, top = 14, bottom = 38;
  const x0 = Math.log2(Math.min(...s.gpus)), x1 = Math.max(Math.log2(Math.max(...s.gpus)), x0 + 1);
  const values = [];
  for (const c of CURVES) s.gpus.forEach((_, i) => values.push(o.value(c.key, i)));
  for (const p of s.measured) values.push(o.measured(p));
  const finiteValues = values.filter((v) => Number.isFinite(v) && (!o.log || v > 0));
  let y0, y1;
  if (o.log) {
    y0 = Math.floor(Math.log2(Math.min(1, ...finiteValues)));
    y1 = Math.ceil(Math.log2(Math.max(2, ...finiteValues)));
  } else { y0 = 0; y1 = Math.max(1.05, Math.max(...finiteValues) * 1.05); }
  const X = (g) => left + (Math.log2(g) - x0) / (x1 - x0) * (w - left - right);
  const Y = (v) => {
    const t = o.log ? (Math.log2(Math.max(v, 2 ** y0)) - y0) / (y1 - y0) : (v - y0) / (y1 - y0);
    return top + (1 - t) * (h - top - bottom);
  };
  const g = svg('svg', {width: w, height: h, role: 'img', 'aria-label': o.label, id: o.id});
  g.append(svg('line', {x1: left, y1: h - bottom, x2: w - right, y2: h - bottom, class: 'axis'}));
  g.append(svg('line', {x1: left, y1: top, x2: left, y2: h - bottom, class: 'axis'}));
  for (const gpus of s.gpus) {
    g.append(svg('line', {x1: X(gpus), y1: top, x2: X(gpus), y2: h - bottom, class: 'axis', 'stroke-opacity': 0.35}));
    g.append(svg('text', {x: X(gpus), y: h - bottom + 15, 'text-anchor': 'middle'}, String(gpus)));
  }
  const ticks = o.log ? Array.from({length: y1 - y0 + 1}, (_, i) => 2 ** (y0 + i)).filter((v, i, a) => a.length <= 8 || i % 2 === 0)
    : [0, 0.25, 0.5, 0.75, 1].map((f) => f * Math.floor(y1));
  for (const v of ticks) {
    g.append(svg('line', {x1: left, y1: Y(v), x2: w - right, y2: Y(v), class: 'axis', 'stroke-opacity': 0.25}));
    g.append(svg('text', {x: left - 6, y: Y(v) + 4, 'text-anchor': 'end'}, o.percent ? pct(v).replace('.0%', '%') : num(v, 2)));
  }
  g.append(svg('text', {x: (left + w - right) / 2, y: h - 6, 'text-anchor': 'middle'}, s.axis || 'GPUs'));
  const mid = top + (h - top - bottom) / 2;
  g.append(svg('text', {x: 12, y: mid, transform: `rotate(-90 12 ${mid})`, 'text-anchor': 'middle'}, o.yLabel));
  if (o.target) {
    const pts = s.gpus.map((gp) => `${X(gp)},${Y(o.target(gp))}`).join(' ');
    g.append(titled(svg('polyline', {points: pts, fill: 'none', stroke: '#54a24b', 'stroke-dasharray': '2 4', 'stroke-width': 2,
      class: 'target'}), `target efficiency ${pct(s.target_efficiency)}`));
  }
  for (const c of CURVES) {
    const pts = s.gpus.map((gp, i) => [gp, o.value(c.key, i)]).filter(([, v]) => Number.isFinite(v) && (!o.log || v > 0));
    if (!pts.length) continue;
    g.append(svg('polyline', {points: pts.map(([gp, v]) => `${X(gp)},${Y(v)}`).join(' '), fill: 'none', stroke: c.color,
      'stroke-width': 2, 'stroke-dasharray': c.dash || null, class: `curve curve-${c.key}`}));
    for (const [gp, v] of pts) {
      g.append(titled(svg('circle', {cx: X(gp), cy: Y(v), r: 3, fill: c.color}),
        `${c.label}: ${o.percent ? pct(v) : `${num(v)}x`} at ${gp} GPUs`));
    }
  }
  if (Number.isFinite(s.recommended_gpus) && s.gpus.includes(s.recommended_gpus)) {
    const x = X(s.recommended_gpus);
    const nearRight = x > w - right - 110;
    g.append(svg('line', {x1: x, y1: top, x2: x, y2: h - bottom, stroke: '#54a24b', 'stroke-width': 2, class: 'recommended'}));
    g.append(svg('text', {x: nearRight ? x - 4 : x + 4, y: top + 10, 'text-anchor': nearRight ? 'end' : 'start'},
      `recommended: ${s.recommended_gpus}`));
  }
  for (const p of s.measured) {
    const v = o.measured(p);
    if (!Number.isFinite(v) || (o.log && v <= 0)) continue;
    g.append(titled(svg('rect', {x: X(p.gpus) - 5, y: Y(v) - 5, width: 10, height: 10, fill: 'none',
      stroke: 'currentColor', 'stroke-width': 2, class: 'measured'}),
      `${p.run}: measured ${o.percent ? pct(v) : `${num(v)}x`} at ${p.gpus} GPUs`));
  }
  return el('div', {}, g);
}

function whatIfSection(view, scaling) {
  const w = view.whatif;
  const field = (name, label, value, placeholder) => el('label', {}, label,
    el('input', {name, value: value === null || value === undefined ? '' : String(value), placeholder}));
  const mode = el('select', {name: 'scaling'}, ['weak', 'strong'].map((m) => el('option', {value: m}, m)));
  mode.value = w.scaling || 'weak';
  const message = el('div', {class: 'error', id: 'whatif-error'});
  const form = el('form', {class: 'whatif', id: 'whatif'},
    field('gpus', 'GPUs', (w.gpus || []).join(','), '1,2,4,8'),
    field('bandwidth', 'link bandwidth', w.bandwidth, 'as measured, e.g. 25Gbit'),
    field('nodes', 'nodes', w.nodes, 'one ring'),
    el('label', {}, 'scaling', mode),
    field('batch', 'per-device batch', w.batch, 'as run'),
    el('button', {type: 'submit'}, 'Project'),
    el('button', {type: 'button', onclick: () => { message.textContent = ''; draw(scaling, () => drawScaling(scaling, view.scaling)); }}, 'Reset'));
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const params = new URLSearchParams({run: view.run});
    for (const [k, v] of new FormData(form)) if (String(v).trim() !== '') params.set(k, String(v).trim());
    message.textContent = '';
    try {
      const answer = await getJSON(`./project?${params}`);
      draw(scaling, () => drawScaling(scaling, answer.scaling));
    } catch (e) { message.textContent = e.message; }
  });
  return el('div', {class: 'card'}, form, message,
    el('div', {class: 'muted'}, 'Projected on the server with the code of `dtprofile project`; the chart above redraws.'));
}

// ----------------------------------------------------------------------------- over time
function overTimeSection(view) {
  const t = view.over_time;
  const holder = el('div', {id: 'over-time'});
  if (!t || !t.steps || t.steps.length === 0) {
    holder.append(el('p', {class: 'muted'}, t && t.error ? t.error : 'No logged intervals in the event files.'));
    return holder;
  }
  requestAnimationFrame(() => draw(holder, () => drawOverTime(holder, t)));
  return holder;
}

function drawOverTime(holder, t) {
  const keys = Object.keys(PART_COLORS).filter((k) => t.series[k]);
  const w = width(holder), h = 220, left = 56, right = 20, top = 10, bottom = 30;
  const totals = t.steps.map((_, i) => keys.reduce((s, k) => s + (t.series[k][i] || 0), 0));
  const yMax = Math.max(1e-9, ...totals) * 1.05;
  const s0 = t.steps[0], s1 = Math.max(t.steps[t.steps.length - 1], s0 + 1);
  const X = (s) => left + (s - s0) / (s1 - s0) * (w - left - right);
  const Y = (v) => top + (1 - v / yMax) * (h - top - bottom);
  const g = svg('svg', {width: w, height: h, role: 'img', 'aria-label': 'step parts per logged interval'});
  const base = t.steps.map(() => 0);
  for (const k of keys) {
    const upper = base.map((b, i) => b + (t.series[k][i] || 0));
    const pts = t.steps.map((s, i) => `${X(s)},${Y(upper[i])}`).concat(
      t.steps.map((s, i) => `${X(s)},${Y(base[i])}`).reverse());
    g.append(titled(svg('polygon', {points: pts.join(' '), fill: PART_COLORS[k], 'fill-opacity': 0.85}), (t.labels || {})[k] || k));
    upper.forEach((v, i) => { base[i] = v; });
  }
  g.append(svg('line', {x1: left, y1: Y(0), x2: w - right, y2: Y(0), class: 'axis'}));
  for (let i = 0; i <= 3; i++) g.append(svg('text', {x: left - 6, y: Y(yMax * i / 3) + 4, 'text-anchor': 'end'}, num(yMax * i / 3, 2)));
  g.append(svg('text', {x: left, y: h - 8}, `step ${s0}`));
  g.append(svg('text', {x: w - right, y: h - 8, 'text-anchor': 'end'}, `step ${t.steps[t.steps.length - 1]}`));
  const labels = t.labels || {};
  put(holder, el('div', {class: 'legend'}, keys.map((k) => el('span', {style: `--swatch:${PART_COLORS[k]}`}, labels[k] || k))),
    g, el('div', {class: 'muted'}, 'ms per step, each logged interval'));
}

// ----------------------------------------------------------------------------- compare
function compareSection(run, other) {
  const holder = el('div', {id: 'compare-view'}, el('p', {class: 'muted'}, 'Comparing…'));
  getJSON(`./compare?baseline=${encodeURIComponent(other)}&candidate=${encodeURIComponent(run)}`).then((c) => {
    const rows = [];
    for (const [group, unit] of [['per_step_ms', ' ms'], ['ratios', '']]) {
      for (const [k, v] of Object.entries(c[group] || {})) {
        if (v.baseline === null && v.candidate === null) continue;
        rows.push(el('tr', {}, el('td', {}, k), el('td', {}, num(v.baseline) + unit), el('td', {}, num(v.candidate) + unit),
          el('td', {}, v.delta_fraction === null || v.delta_fraction === undefined ? '–' : `${v.delta_fraction > 0 ? '+' : ''}${pct(v.delta_fraction)}`)));
      }
    }
    const advice = c.advice;
    const tp = c.throughput || {};
    const ids = (list) => (list || []).join(', ') || 'none';
    put(holder, 
      (c.different_jobs || []).length ? el('div', {class: 'error'}, `Not the same job: ${c.different_jobs.join('; ')}`) : null,
      tp.speedup ? el('p', {}, `Throughput: ${num(tp.speedup)}x the baseline's (${tp.basis || ''})`) : null,
      el('table', {}, el('tr', {}, ['', `${other} (baseline)`, run, 'change'].map((t) => el('th', {}, t))), rows),
      el('p', {class: 'muted'}, advice
        ? `Findings resolved: ${ids(advice.resolved)}; new: ${ids(advice.new)}; remaining: ${ids(advice.remaining)}`
        : 'Findings: not known for a run rebuilt from its event files.'));
  }).catch((e) => put(holder, el('div', {class: 'error'}, e.message)));
  return holder;
}
