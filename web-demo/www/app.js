// prefixroute web demo: draws what prefixroute-core (compiled to WebAssembly) decides.
// No routing, scoring or caching logic lives here: every number comes from the wasm module.

import init, { defaults as coreDefaults, WebDemo } from './pkg/prefixroute_web_demo.js';

const $ = (selector, root = document) => root.querySelector(selector);

/** Creates an element: h('div', {class: 'x', title: 'y'}, child, 'text', …). */
function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'class') node.className = value;
    else if (key === 'style') node.style.cssText = value;
    else if (key === 'dataset') Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? '' : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG = 'http://www.w3.org/2000/svg';
function s(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

// ---------------------------------------------------------------------------------------------
// Formatting and colours

const pct = (x) => (Number.isFinite(x) ? `${(x * 100).toFixed(1)}%` : 'n/a');
const ms = (x) => (Number.isFinite(x) ? (x >= 1000 ? `${(x / 1000).toFixed(2)} s` : `${Math.round(x)} ms`) : 'n/a');
/** Like Rust's `{:.N}` (exact halves round to even), so numbers match core's explanation line. */
function fixed(x, digits) {
  const scale = 10 ** digits;
  const y = x * scale;
  const r = Math.abs(y % 1) === 0.5 ? 2 * Math.round(y / 2) : Math.round(y);
  return (r / scale).toFixed(digits);
}
const num = (x, digits = 2) => (Number.isFinite(x) ? fixed(x, digits) : 'n/a');
const signed = (x) => `${x >= 0 ? '+' : '−'}${num(Math.abs(x))}`;

const PALETTE = [
  '#4e79a7', '#f28e2b', '#e15759', '#76b7b2', '#59a14f', '#edc948',
  '#b07aa1', '#ff9da7', '#9c755f', '#17becf', '#bcbd22', '#8c564b',
];
const SHARED_COLOR = '#94a3b8';
function groupColor(g) {
  if (g < 0) return SHARED_COLOR;
  if (g < PALETTE.length) return PALETTE[g];
  return `hsl(${Math.round((g * 137.508) % 360)} 55% 52%)`;
}
const POLICY_COLORS = {
  latency: '#16a34a',
  prefix: '#4f46e5',
  'prefix-only': '#0d9488',
  'least-queue': '#d97706',
  'round-robin': '#e11d48',
  random: '#64748b',
};
const SCORERS = [
  { key: 'prefix', weight: 'prefix', label: 'prefix', color: '#4f46e5', title: 'prefix-cache: matched blocks / total blocks' },
  { key: 'queue', weight: 'queue', label: 'queue', color: '#0d9488', title: 'queue: (max − q) / (max − min) over measured replicas' },
  { key: 'kv_cache', weight: 'kv_cache', label: 'kv-cache', color: '#d97706', title: 'kv-cache-utilization: 1 − KV-cache usage' },
  { key: 'no_hit_lru', weight: 'no_hit_lru', label: 'no-hit-lru', color: '#94a3b8', title: 'no-hit-lru: 0.5 for all when any replica matches; otherwise favours the replica that least recently took a cold request' },
];
/** Which scorers a policy's total uses (the others are computed but ignored): core's own
 *  `Policy::scorers`, read from its defaults at start-up. */
const USED = {};
/** Policies that pick by a predicted cost (core's `Policy::predicts`). */
const PREDICTING = new Set();
/** The columns of a predicting policy: fields of core's `Prediction`. */
const PREDICTION_COLUMNS = [
  { key: 'uncached_tokens', label: 'uncached', unit: 'tokens', title: "the prompt tokens this replica would have to prefill (what it is believed not to hold, by the server's rules)" },
  { key: 'queue_ms', label: 'queue', unit: 'ms', title: 'predicted wait for a lane: the prefill work ahead of this request, spread over the learned lanes' },
  { key: 'ttft_ms', label: 'TTFT', unit: 'ms', title: 'predicted time to first token: overhead + queue + uncached × learned ms per token' },
  { key: 'delay_to_others_ms', label: 'delay to others', unit: 'ms', title: 'where requests queue, this prefill also delays those that arrive after it' },
  { key: 'room_ms', label: 'room', unit: 'ms', title: "the prefill the blocks this request brings will cost later: they take room in the replica's cache in proportion to its occupancy" },
  { key: 'copy_credit_ms', label: 'copy credit', unit: 'ms', title: "taken off the cost: what a copy of this prefix here would save the requests that share it and queue where it is held (a group's first request only)" },
  { key: 'caution_ms', label: 'caution', unit: 'ms', title: 'added to the cost of a request no replica holds any of: the work in flight here spread over the fewest lanes the first bytes have not ruled out (a lane free now is not free for a whole prefill)' },
];

// ---------------------------------------------------------------------------------------------
// State

const app = {
  defaults: null,      // core's defaults: {trace, sim, policies, shapes, limits}
  settings: null,      // what the current run was built from
  demo: null,          // WebDemo (wasm)
  info: null,          // {replicas, groups, config, requests}
  compare: null,       // [{policy, report, hit_series, max_over_mean}], null while computing
  compareKey: null,    // settings (minus the policy) the comparison was computed for
  generation: 0,
  series: [],          // live fleet hit rate after each step
  last: null,          // last step view
  slots: [],           // per replica: stable cell positions for cached blocks
  timer: null,
  running: false,
};

// ---------------------------------------------------------------------------------------------
// Settings form <-> core's TraceSpec / SimConfig

const form = $('#settings');
const field = (name) => form.elements.namedItem(name);

function fillForm(d) {
  const { trace, sim } = d;
  field('shape').value = trace.shape;
  field('script').value = trace.script;
  field('tenants').value = trace.tenants;
  field('prompt_words').value = trace.prompt_words;
  field('question_words').value = trace.question_words;
  field('requests').value = trace.requests;
  field('rate').value = trace.rate;
  field('hot').value = trace.hot ?? 0;
  field('seed').value = trace.seed;
  field('replicas').value = sim.replicas;
  field('cache_blocks').value = sim.cache_blocks;
  field('capacity_reported').checked = sim.capacity_reported;
  field('block_size').value = sim.router.hash.block_size;
  field('slots').value = sim.timing.lanes;
  field('policy').value = sim.router.policy;
  field('w_prefix').value = sim.router.weights.prefix;
  field('w_queue').value = sim.router.weights.queue;
  field('w_kv').value = sim.router.weights.kv_cache;
  field('w_lru').value = sim.router.weights.no_hit_lru;
}

/** Reads the form into core's types, starting from core's defaults. Null when a field is invalid. */
function readForm() {
  const invalid = [...form.elements].filter((el) => el.willValidate && !el.checkValidity());
  for (const el of form.elements) el.removeAttribute?.('aria-invalid');
  if (invalid.length) {
    for (const el of invalid) el.setAttribute('aria-invalid', 'true');
    const names = invalid.map((el) => el.labels?.[0]?.textContent ?? el.name);
    showError(`Check ${names.join(', ')}: ${invalid[0].validationMessage}`);
    return null;
  }
  const settings = structuredClone({ trace: app.defaults.trace, sim: app.defaults.sim });
  const int = (name) => Number.parseInt(field(name).value, 10);
  const real = (name) => Number.parseFloat(field(name).value);
  const { trace, sim } = settings;
  trace.shape = field('shape').value;
  trace.script = field('script').value;
  trace.tenants = int('tenants');
  trace.prompt_words = int('prompt_words');
  trace.question_words = int('question_words');
  trace.requests = int('requests');
  trace.rate = real('rate');
  const hot = real('hot');
  trace.hot = hot > 0 ? hot : null;
  trace.seed = int('seed');
  sim.router.seed = int('seed');
  sim.replicas = int('replicas');
  sim.cache_blocks = int('cache_blocks');
  sim.capacity_reported = field('capacity_reported').checked;
  sim.router.hash.block_size = int('block_size');
  sim.timing.lanes = int('slots');
  sim.router.policy = field('policy').value;
  sim.router.weights = {
    prefix: real('w_prefix'),
    queue: real('w_queue'),
    kv_cache: real('w_kv'),
    no_hit_lru: real('w_lru'),
  };
  return settings;
}

function showError(message) {
  const box = $('#error');
  box.textContent = message;
  box.hidden = !message;
}

// ---------------------------------------------------------------------------------------------
// Building a run

/** Regenerates the trace and restarts the run from the form (Reset does this too). */
function rebuild({ onlyIfChanged = false } = {}) {
  const settings = readForm();
  if (!settings) {
    pause();
    return;
  }
  if (onlyIfChanged && app.settings && JSON.stringify(settings) === JSON.stringify(app.settings)) {
    showError('');
    return;
  }
  pause();
  let demo;
  try {
    demo = new WebDemo(JSON.stringify(settings));
  } catch (err) {
    showError(String(err.message ?? err));
    return;
  }
  showError('');
  app.demo?.free();
  app.demo = demo;
  app.settings = settings;
  app.info = JSON.parse(demo.info());
  app.series = [];
  app.last = null;
  scheduleCompare(demo, settings);
  buildReplicaCards();
  renderLegend();
  renderCompare();
  renderPreview();
  renderReplicas(JSON.parse(demo.replicas()), null);
  renderChart();
  renderLive(null);
  updateButtons();
  updateDownload();
}

/**
 * The comparison runs core's simulation once per policy, which takes a moment on big traces:
 * it runs after the page has drawn, and only when the trace or fleet changed (switching the
 * selected policy reuses it).
 */
function scheduleCompare(demo, settings) {
  scheduleBeliefs(demo, settings);
  const key = JSON.stringify({ ...settings, sim: { ...settings.sim, router: { ...settings.sim.router, policy: null } } });
  if (key === app.compareKey && app.compare) return;
  app.compareKey = key;
  app.compare = null;
  const generation = (app.generation = (app.generation ?? 0) + 1);
  $('#compare').setAttribute('aria-busy', 'true');
  setTimeout(() => {
    if (generation !== app.generation || demo !== app.demo) return;
    try {
      app.compare = JSON.parse(demo.compare());
    } catch (err) {
      app.compare = [];
      showError(String(err.message ?? err));
    }
    $('#compare').removeAttribute('aria-busy');
    renderCompare();
    renderChart();
  }, 30);
}

function updateDownload() {
  const link = $('#download');
  if (link.dataset.url) URL.revokeObjectURL(link.dataset.url);
  const url = URL.createObjectURL(new Blob([app.demo.traceJsonl()], { type: 'application/x-ndjson' }));
  link.href = url;
  link.dataset.url = url;
  link.download = `trace-seed${app.settings.trace.seed}.jsonl`;
}

// ---------------------------------------------------------------------------------------------
// Playback

function stepOnce() {
  if (!app.demo || app.demo.isDone()) return false;
  const view = JSON.parse(app.demo.step());
  if (!view) return false;
  app.series.push(view.hit_rate);
  renderStep(view);
  return true;
}

function run() {
  if (!app.demo || app.demo.isDone() || app.running) return;
  app.running = true;
  const speed = $('#speed').value;
  if (speed === 'max') {
    const frame = () => {
      if (!app.running) return;
      const started = performance.now();
      let batch = 1;
      let out;
      // Run as many requests as fit in ~25 ms, draw once.
      do {
        out = JSON.parse(app.demo.advance(batch));
        for (const st of out.steps) app.series.push(st.hit_rate);
        if (out.last) app.last = out.last;
        batch = Math.min(batch * 2, 256);
      } while (!out.done && performance.now() - started < 25);
      if (app.last) renderStep(app.last);
      if (out.done) pause();
      else app.timer = requestAnimationFrame(frame);
    };
    app.timer = requestAnimationFrame(frame);
  } else {
    const interval = 1000 / Number(speed);
    const tick = () => {
      if (!app.running) return;
      if (!stepOnce() || app.demo.isDone()) {
        pause();
        return;
      }
      app.timer = setTimeout(tick, interval);
    };
    tick();
  }
  updateButtons();
}

function pause() {
  app.running = false;
  if (app.timer !== null) {
    clearTimeout(app.timer);
    cancelAnimationFrame(app.timer);
    app.timer = null;
  }
  updateButtons();
}

function updateButtons() {
  const ready = Boolean(app.demo);
  const done = ready && app.demo.isDone();
  $('#run').disabled = !ready || done || app.running;
  $('#pause').disabled = !app.running;
  $('#step').disabled = !ready || done || app.running;
  $('#reset').disabled = !ready;
  document.body.classList.toggle('is-running', app.running);
}

// ---------------------------------------------------------------------------------------------
// Routing decision panel

function blocksOf(request) {
  // Every chain's blocks in order (chat requests have one chain).
  return request.chains.flatMap((chain, c) => chain.blocks.map((b, i) => ({ ...b, chain: c, i })));
}

function renderStrip(request) {
  const strip = $('#strip');
  strip.replaceChildren();
  const blocks = blocksOf(request);
  strip.style.setProperty('--n', String(Math.max(blocks.length, 1)));
  for (const b of blocks) {
    const owner = b.group < 0 ? 'shared' : app.info.groups[b.group];
    strip.append(h('span', {
      class: `blk${b.full ? '' : ' partial'}`,
      style: `--c:${groupColor(b.group)}`,
      title: `block ${b.i} · ${b.hash} · ${owner}${b.full ? '' : ' · partial'}`,
      dataset: { hash: b.hash },
    }));
  }
  strip.setAttribute('aria-label', `${blocks.length} block hashes of ${request.group}'s prompt`);
}

function matchCell(request, replica) {
  const cell = h('div', { class: 'match' });
  let belief = 0;
  let server = 0;
  let total = 0;
  const bar = h('div', { class: 'mini', 'aria-hidden': 'true', style: `--n:${Math.max(blocksOf(request).length, 1)}` });
  let held = 0;
  let stale = 0;
  for (const chain of request.chains) {
    stale += chain.stale_blocks[replica];
    const b = chain.belief_match[replica];
    const sv = chain.server_held[replica];
    belief += b;
    server += chain.server_match[replica];
    held += sv;
    total += chain.blocks.length;
    chain.blocks.forEach((_, i) => {
      const kind = i < b && i < sv ? 'both' : i < b && chain.blocks[i].full ? 'belief' : i < sv ? 'server' : 'none';
      bar.append(h('i', { class: `m ${kind}` }));
    });
  }
  const differs = stale > 0 || held > belief;
  cell.append(bar, h('span', { class: 'match-num', title: `router believes ${belief} of ${total} blocks; the replica's cache holds the first ${held} and would reuse ${server}` },
    `${belief}/${total}`, differs ? h('small', {}, ` cache ${held}`) : null));
  return cell;
}

function predictionHead() {
  const row = h('tr', {}, h('th', { scope: 'col' }, 'Replica'), h('th', { scope: 'col' }, 'Prefix match'));
  for (const c of PREDICTION_COLUMNS) {
    row.append(h('th', { scope: 'col', class: 'num', title: c.title }, c.label, h('small', { class: 'weight' }, c.unit)));
  }
  row.append(h('th', { scope: 'col', class: 'total-col' }, 'Predicted cost', h('small', { class: 'weight' }, 'ms, lowest wins')));
  return row;
}

/** The latency policy's table: core's Prediction per replica. */
function renderPredictions(request, decision) {
  const table = $('#scores');
  table.tHead.replaceChildren(predictionHead());
  const body = table.tBodies[0];
  body.replaceChildren();
  const costs = decision ? decision.scores.filter((x) => !x.excluded).map((x) => x.prediction.cost_ms) : [];
  const worst = Math.max(1, ...costs);
  app.info.replicas.forEach((name, i) => {
    const sc = decision?.scores[i];
    const p = sc?.prediction;
    const row = h('tr', { dataset: { replica: String(i) } });
    const flags = h('div', { class: 'flags' });
    row.append(h('th', { scope: 'row' }, name, flags), h('td', {}, matchCell(request, i)));
    for (const c of PREDICTION_COLUMNS) {
      const value = p ? p[c.key] : null;
      const extra = p && c.key === 'queue_ms' ? ` (${num(p.queue_requests, 1)} requests ahead, ${p.lanes} lanes)` :
        p && c.key === 'ttft_ms' ? ` (at ${num(p.ms_per_token, 3)} ms/token)` :
        p && c.key === 'room_ms' ? ` (${num(p.room_blocks, 1)} blocks at ${pct(sc.room.believed_blocks / Math.max(1, sc.room.capacity_blocks))} occupancy)` : '';
      row.append(h('td', { class: 'num', dataset: { prediction: c.key }, title: p ? `${c.label} ${num(value, 1)}${extra}` : '' },
        p ? (c.unit === 'ms' ? ms(value) : String(value)) : '–'));
    }
    const totalCell = h('td', { class: 'total-col', dataset: { total: p ? String(p.cost_ms) : '' } });
    if (p) {
      const bar = h('div', { class: 'stack', 'aria-hidden': 'true' });
      for (const [part, color] of [[p.ttft_ms, '#16a34a'], [p.delay_to_others_ms, '#d97706'], [p.room_ms, '#94a3b8']]) {
        if (part > 0) bar.append(h('i', { style: `width:${(100 * part) / worst}%;--c:${color}` }));
      }
      totalCell.append(h('span', { class: 'total-num' }, ms(p.cost_ms)), bar);
    } else {
      totalCell.append('–');
    }
    row.append(totalCell);
    if (decision) {
      if (i === decision.endpoint) flags.append(h('span', { class: 'chip win' }, 'winner'));
      if (i === decision.runner_up) flags.append(h('span', { class: 'chip' }, 'runner-up'));
      if (sc.continues) flags.append(h('span', { class: 'chip' }, 'continues'));
      if (sc.excluded) flags.append(h('span', { class: 'chip bad' }, 'excluded'));
      row.classList.toggle('winner', i === decision.endpoint);
      row.classList.toggle('excluded', sc.excluded);
    }
    body.append(row);
  });
}

function scoresHead(policy, weights, decided) {
  const used = USED[policy];
  const row = h('tr', {}, h('th', { scope: 'col' }, 'Replica'), h('th', { scope: 'col' }, 'Prefix match'));
  for (const sc of SCORERS) {
    const on = used.includes(sc.key);
    const weight = policy === 'prefix' ? ` ×${weights[sc.weight]}` : '';
    row.append(h('th', { scope: 'col', class: `num${on ? '' : ' unused'}`, title: on ? sc.title : `${sc.title} (not used by ${policy})` },
      h('span', { class: 'swatch', style: `--c:${sc.color}` }), sc.label, h('small', { class: 'weight' }, on ? weight || 'used' : 'not used')));
  }
  row.append(h('th', { scope: 'col', class: 'total-col' }, policy === 'prefix' ? 'Weighted total' : 'Policy score',
    h('small', { class: 'weight' }, policy === 'prefix' ? 'Σ weight × score' : USED[policy].length ? 'highest wins' : 'not scored')));
  return row;
}

function renderScores(request, decision) {
  if (PREDICTING.has(app.info.config.router.policy)) {
    renderPredictions(request, decision);
    return;
  }
  const table = $('#scores');
  const cfg = app.info.config;
  const policy = cfg.router.policy;
  const weights = cfg.router.weights;
  table.tHead.replaceChildren(scoresHead(policy, weights, Boolean(decision)));
  const body = table.tBodies[0];
  body.replaceChildren();
  const maxTotal = SCORERS.reduce((sum, sc) => sum + weights[sc.weight], 0) || 1;
  app.info.replicas.forEach((name, i) => {
    const sc = decision?.scores[i];
    const row = h('tr', { dataset: { replica: String(i) } });
    const flags = h('div', { class: 'flags' });
    row.append(h('th', { scope: 'row' }, name, flags), h('td', {}, matchCell(request, i)));
    for (const scorer of SCORERS) {
      const on = USED[policy].includes(scorer.key);
      const value = sc ? sc[scorer.key] : null;
      const contrib = sc && policy === 'prefix' ? ` (×${weights[scorer.weight]} = ${num(value * weights[scorer.weight])})` : '';
      row.append(h('td', { class: `num${on ? '' : ' unused'}`, dataset: { scorer: scorer.key }, title: sc ? `${scorer.label} ${num(value, 3)}${contrib}` : '' },
        sc ? num(value) : '–'));
    }
    const totalCell = h('td', { class: 'total-col', dataset: { total: sc ? String(sc.total) : '' } });
    if (sc) {
      if (policy === 'prefix') {
        const bar = h('div', { class: 'stack', 'aria-hidden': 'true' });
        for (const scorer of SCORERS) {
          const part = sc[scorer.key] * weights[scorer.weight];
          if (part > 0) bar.append(h('i', { style: `width:${(100 * part) / maxTotal}%;--c:${scorer.color}` }));
        }
        totalCell.append(h('span', { class: 'total-num' }, num(sc.total)), bar);
      } else {
        totalCell.append(h('span', { class: 'total-num' }, USED[policy].length ? num(sc.total) : 'not scored'));
      }
    } else {
      totalCell.append('–');
    }
    row.append(totalCell);
    if (decision) {
      if (i === decision.endpoint) flags.append(h('span', { class: 'chip win' }, 'winner'));
      if (i === decision.runner_up) flags.append(h('span', { class: 'chip' }, 'runner-up'));
      if (decision.tie && sc.total === decision.scores[decision.endpoint].total && !sc.excluded) {
        flags.append(h('span', { class: 'chip tie' }, 'tie'));
      }
      if (sc.saturated) flags.append(h('span', { class: 'chip warn' }, 'saturated'));
      if (sc.excluded) flags.append(h('span', { class: 'chip bad' }, 'excluded'));
      row.classList.toggle('winner', i === decision.endpoint);
      row.classList.toggle('excluded', sc.excluded);
    }
    body.append(row);
  });
}

function requestMeta(request) {
  const full = request.chains.reduce((n, c) => n + c.full_blocks, 0);
  const partial = request.blocks - full;
  return [
    h('span', { class: 'tenant', style: `--c:${groupColor(request.group_index)}`, dataset: { testid: 'tenant' } }, request.group),
    ` Request #${request.index} at t = ${request.t.toFixed(3)} s · ${request.tokens} prompt tokens = ${request.blocks} blocks of ${request.block_size} tokens`,
    partial ? ` (${full} full + ${partial} partial)` : '',
    ` · ${request.output_tokens} output tokens`,
  ];
}

function renderPreview() {
  const next = JSON.parse(app.demo.nextRequest());
  if (!next) return;
  $('#request-meta').replaceChildren(...requestMeta(next));
  renderStrip(next);
  renderScores(next, null);
  $('#verdict').replaceChildren(
    h('p', { class: 'eyebrow' }, 'Not routed yet'),
    h('p', {}, `Press `, h('b', {}, 'Step'), ` to let core's router score the ${app.info.replicas.length} replicas for this request, pick one, and serve it on the simulated vLLM replica.`),
    h('p', { class: 'muted' }, `Policy: ${app.info.config.router.policy}. The table shows what the router believes each replica holds (its index) and what each replica's cache really holds.`),
  );
}

/** Sentences explaining core's Decision. */
function explain(view) {
  const d = view.step.decision;
  const cfg = app.info.config;
  const w = cfg.router.weights;
  const sat = cfg.router.saturation;
  const names = app.info.replicas;
  const win = d.endpoint;
  const sc = d.scores;
  const matched = sc[win].matched_blocks;
  const why = [];
  const limits = `queue ≥ ${sat.queue_threshold} or KV-cache use ≥ ${Math.round(sat.kv_threshold * 100)}%`;
  sc.forEach((x, i) => {
    if (x.away_from_head) {
      why.push(`${names[i]} was set aside: this is its group's second request, placed again now that the group is known to grow, and a group moves only to a replica that holds its shared head (anywhere else it would copy it).`);
    } else if (x.over_share) {
      why.push(`${names[i]} was set aside: it holds this request's prefix, which starts more groups than one replica's fair share, and it has taken more than ${cfg.router.latency.balance_factor} times the mean replica's recent requests; the prefix gets another copy (latency.balance_factor).`);
    } else if (x.excluded) {
      why.push(x.saturated
        ? `${names[i]} was set aside: saturated (${limits}) while another replica had room.`
        : `${names[i]} was set aside: down.`);
    }
  });
  const saturatedKept = sc.filter((x) => x.saturated && !x.excluded).length;
  if (d.policy === 'prefix' && saturatedKept > 0) {
    why.push(`No replica had room (every one is saturated: ${limits}), so the saturation filter set none aside.`);
  }
  switch (d.policy) {
    case 'latency': {
      const p = sc[win].prediction;
      const parts = [`${ms(cfg.router.latency.overhead_ms)} overhead`];
      if (p.queue_ms > 0) parts.push(`${ms(p.queue_ms)} waiting for one of ${p.lanes} lanes (${num(p.queue_requests, 1)} requests ahead)`);
      parts.push(`${p.uncached_tokens} uncached tokens × ${num(p.ms_per_token, 3)} ms`);
      why.push(`${names[win]} is believed to hold ${matched} of ${d.total_blocks} blocks; its predicted TTFT is ${ms(p.ttft_ms)} = ${parts.join(' + ')}.`);
      if (p.delay_to_others_ms > 0) why.push(`Its queue also makes this prefill delay later requests by about ${ms(p.delay_to_others_ms)}.`);
      if (p.caution_ms > 0) why.push(`No replica holds any of it, so nothing is gained by stacking it behind the prefills in flight here: ${ms(p.caution_ms)} is added to its cost: the prefill and decode work in flight here spread over the fewest lanes its first bytes have not ruled out (a lane free now is not free for its whole prefill, and the requests of the groups living here would find it taken).`);
      if (p.copy_credit_ms > 0) why.push(`A copy of the prefix here saves the requests queueing for it where it is held about ${ms(p.copy_credit_ms)}, taken off the cost.`);
      if (p.room_ms > 0) {
        why.push(`The ${num(p.room_blocks, 1)} blocks it brings (${sc[win].continues ? (d.continued === 'First' ? "its new blocks and, this being its group's second request, the growth now expected of the group" : 'its own new blocks: it continues an earlier request there') : 'new blocks and the growth expected of a group that starts here'}) take room in a cache that is ${pct(sc[win].room.believed_blocks / Math.max(1, sc[win].room.capacity_blocks))} full: ${ms(p.room_ms)} of later prefill.`);
      }
      break;
    }
    case 'round-robin':
      why.push('Round-robin takes the next replica in rotation. The scores are computed for reference and ignored.');
      break;
    case 'random':
      why.push("Random draws a replica with the router's seeded RNG. The scores are computed for reference and ignored.");
      break;
    case 'least-queue':
      why.push(`Least-queue picks the best queue score (the shortest waiting queue): ${names[win]} scores ${num(sc[win].queue)}.`);
      break;
    case 'prefix-only':
      why.push(d.cold
        ? 'No replica holds any block of this prompt: every prefix score is 0.'
        : `${names[win]} is believed to hold ${matched} of ${d.total_blocks} blocks, the best prefix ratio. Load is ignored.`);
      break;
    default: {
      if (d.cold) {
        const setAsideHolders = sc.some((x) => x.excluded && x.matched_blocks > 0);
        why.push(`${setAsideHolders ? 'Cold among the eligible replicas: only a set-aside replica holds blocks of this prompt.' : 'Cold request: no replica holds any block of this prompt, so every prefix score is 0.'} no-hit-lru (×${w.no_hit_lru}) favours the replica that least recently took a cold request: ${names[win]} scores ${num(sc[win].no_hit_lru)}.`);
      } else {
        why.push(`${names[win]} is believed to hold ${matched} of ${d.total_blocks} blocks: prefix ${num(sc[win].prefix)} ×${w.prefix} = ${num(sc[win].prefix * w.prefix)}.`);
      }
    }
  }
  if (d.policy === 'latency' && d.runner_up !== null && d.runner_up !== undefined) {
    const r = d.runner_up;
    const a = sc[win].prediction;
    const b = sc[r].prediction;
    let line = `Predicted cost ${ms(a.cost_ms)} against ${names[r]}'s ${ms(b.cost_ms)}`;
    const terms = [
      { label: 'prefill', diff: (b.uncached_tokens * b.ms_per_token) - (a.uncached_tokens * a.ms_per_token) },
      { label: 'queue', diff: b.queue_ms - a.queue_ms },
      { label: 'delay to others', diff: b.delay_to_others_ms - a.delay_to_others_ms },
      { label: 'room', diff: b.room_ms - a.room_ms },
      { label: 'without a copy credit', diff: (a.copy_credit_ms || 0) - (b.copy_credit_ms || 0) },
      { label: 'caution', diff: (b.caution_ms || 0) - (a.caution_ms || 0) },
    ];
    const best = terms.reduce((x, y) => (y.diff > x.diff ? y : x));
    line += best.diff > 0 ? `: ${names[r]} would cost ${ms(best.diff)} more ${best.label}.` : '.';
    why.push(line);
  } else if (d.runner_up !== null && d.runner_up !== undefined && USED[d.policy].length) {
    const r = d.runner_up;
    const margin = sc[win].total - sc[r].total;
    let line = `It scores ${num(sc[win].total)} against ${names[r]}'s ${num(sc[r].total)}.`;
    if (d.policy === 'prefix' && margin > 0) {
      const terms = SCORERS.map((x) => ({ label: x.label, diff: w[x.weight] * (sc[win][x.key] - sc[r][x.key]) }));
      const best = terms.reduce((a, b) => (b.diff > a.diff ? b : a));
      const against = terms.reduce((a, b) => (b.diff < a.diff ? b : a));
      line += ` The ${best.label} score made the difference (${signed(best.diff)})`;
      line += against.diff < -1e-9 ? `; ${against.label} pulled the other way (${signed(against.diff)}).` : '.';
    }
    why.push(line);
  }
  if (d.tie) {
    why.push(d.policy === 'latency'
      ? 'Several replicas were predicted within 2% of the best: core kept the request where its group lives if that was one of them, then took the one with the fewest requests in flight, then the most free room in its cache once the conversations living there grow, then the one its first block hashes highest with (every router agrees on it without talking).'
      : `Exact tie at ${num(sc[win].total)}: core broke it with its seeded random draw.`);
  }
  if (d.all_down) why.push('Every replica was down, so health was ignored.');
  return why;
}

function renderVerdict(view) {
  const d = view.step.decision;
  const served = view.step.served;
  const names = app.info.replicas;
  const request = view.request;
  const hit = served.cached_tokens > 0;
  const share = served.prompt_tokens ? served.cached_tokens / served.prompt_tokens : 0;
  const reused = served.cached_tokens / request.block_size;
  const belief = d.scores[d.endpoint].matched_blocks;
  const stale = request.chains.reduce((n, c) => n + c.stale_blocks[d.endpoint], 0);
  const flags = [];
  if (d.cold) flags.push(h('span', { class: 'chip' }, 'cold'));
  if (d.tie) flags.push(h('span', { class: 'chip tie' }, 'tie'));
  if (d.scores.some((x) => x.saturated)) flags.push(h('span', { class: 'chip warn' }, 'saturated'));
  if (d.scores.some((x) => x.excluded)) flags.push(h('span', { class: 'chip bad' }, 'excluded'));
  if (stale) flags.push(h('span', { class: 'chip bad' }, 'stale belief'));

  $('#verdict').replaceChildren(...[
    h('p', { class: 'eyebrow' }, `${d.policy} routed it to`),
    h('div', { class: 'winner-line' },
      h('span', { class: 'winner-name', dataset: { testid: 'winner' } }, names[d.endpoint]),
      h('span', { class: `outcome ${hit ? 'hit' : 'miss'}`, dataset: { testid: 'outcome' } }, hit ? 'HIT' : 'MISS'),
      ...flags),
    h('p', { class: 'served' },
      h('b', {}, `${served.cached_tokens} of ${served.prompt_tokens}`), ` prompt tokens came from ${names[d.endpoint]}'s own cache (${pct(share)}). `,
      `TTFT ${ms(served.ttft_ms)}`, served.wait_ms > 0 ? `, of which ${ms(served.wait_ms)} waiting for a lane` : '',
      ` · queue at arrival ${served.queue_at_arrival}.`),
    stale ? h('p', { class: 'note' }, `The router believed ${belief} blocks were there, but the replica had evicted ${stale} of them and reused ${reused}. The index is a belief, not a fact.`) : null,
    h('ul', { class: 'why' }, explain(view).map((line) => h('li', {}, line))),
    h('p', { class: 'core-line', title: "core's own one-line explanation (Step::explain)" }, h('code', {}, view.explanation)),
  ].filter(Boolean));
}

function renderStep(view) {
  app.last = view;
  $('#request-meta').replaceChildren(...requestMeta(view.request));
  renderStrip(view.request);
  renderScores(view.request, view.step.decision);
  renderVerdict(view);
  renderReplicas(view.replicas, view);
  renderChart();
  renderLive(view);
  updateButtons();
}

function renderLive(view) {
  const total = app.info.requests.length;
  const done = app.demo.stepsDone();
  $('#progress').textContent = `${done} / ${total}`;
  const report = view?.report;
  $('#live-hit').textContent = report && report.requests ? pct(report.hit_rate) : 'n/a';
  $('#live-p50').textContent = report && report.requests ? ms(report.ttft_p50_ms) : 'n/a';
  $('#live-p95').textContent = report && report.requests ? ms(report.ttft_p95_ms) : 'n/a';
}

// ---------------------------------------------------------------------------------------------
// Replicas: cache grids with stable cell positions, lanes and hit rates

/** Keeps each cached block in the same cell while it stays cached, so evictions show. */
class SlotMap {
  constructor(capacity) {
    this.cells = new Array(capacity).fill(null);
    this.where = new Map();
  }

  update(blocks) {
    const present = new Set(blocks);
    const evicted = new Set();
    for (const [hash, cell] of this.where) {
      if (!present.has(hash)) {
        this.where.delete(hash);
        this.cells[cell] = null;
        evicted.add(cell);
      }
    }
    const added = new Set();
    // Fill cells that were already empty first, so a freshly evicted cell stays visible.
    const free = [];
    const freed = [];
    this.cells.forEach((v, i) => { if (v === null) (evicted.has(i) ? freed : free).push(i); });
    const order = free.concat(freed);
    let k = 0;
    for (const hash of blocks) {
      if (this.where.has(hash)) continue;
      const cell = order[k++];
      if (cell === undefined) break;
      this.cells[cell] = hash;
      this.where.set(hash, cell);
      added.add(cell);
    }
    return { evicted, added };
  }
}

function cellSize(capacity) {
  if (capacity <= 96) return 12;
  if (capacity <= 256) return 9;
  if (capacity <= 1024) return 6;
  return 4;
}

function buildReplicaCards() {
  const box = $('#replica-cards');
  box.replaceChildren();
  app.slots = [];
  const cfg = app.info.config;
  app.info.replicas.forEach((name, i) => {
    app.slots.push(new SlotMap(cfg.cache_blocks));
    const grid = h('div', { class: 'grid', role: 'img', style: `--cell:${cellSize(cfg.cache_blocks)}px` });
    for (let c = 0; c < cfg.cache_blocks; c += 1) grid.append(h('i', { class: 'cell' }));
    const lanes = h('div', { class: 'lanes', 'aria-hidden': 'true' });
    const shown = Math.min(cfg.timing.lanes, 16);
    for (let l = 0; l < shown; l += 1) lanes.append(h('i', { class: 'lane' }));
    box.append(h('article', { class: 'replica', dataset: { replica: String(i) }, 'aria-label': name },
      h('header', {}, h('h3', {}, name), h('span', { class: 'pick' })),
      h('dl', { class: 'stats' },
        h('div', {}, h('dt', {}, 'hit rate'), h('dd', { class: 'hit' }, 'n/a')),
        h('div', {}, h('dt', {}, 'requests'), h('dd', { class: 'reqs' }, '0')),
        h('div', {}, h('dt', {}, 'cache'), h('dd', { class: 'used' }, `0/${cfg.cache_blocks}`)),
        h('div', {}, h('dt', {}, 'queue'), h('dd', { class: 'queue' }, '0'))),
      h('div', { class: 'lanes-row' }, h('span', { class: 'lanes-label' }, 'lanes'), lanes, h('span', { class: 'lanes-num' }, `0/${cfg.timing.lanes}`)),
      grid));
  });
}

function renderReplicas(replicas, view) {
  const cards = $('#replica-cards').children;
  const current = new Set(view ? blocksOf(view.request).map((b) => b.hash) : []);
  const decision = view?.step.decision;
  replicas.forEach((r, i) => {
    const card = cards[i];
    if (!card) return;
    const slots = app.slots[i];
    const groupOf = new Map(r.blocks.map((hash, k) => [hash, r.groups[k]]));
    const { evicted, added } = slots.update(r.blocks);
    const cells = card.querySelector('.grid').children;
    const counts = new Map();
    for (let c = 0; c < cells.length; c += 1) {
      const hash = slots.cells[c];
      const cell = cells[c];
      let cls = 'cell';
      if (hash === null) {
        cell.style.removeProperty('--c');
        cell.removeAttribute('title');
        if (evicted.has(c)) cls += ' evicted';
      } else {
        const g = groupOf.get(hash);
        counts.set(g, (counts.get(g) ?? 0) + 1);
        cell.style.setProperty('--c', groupColor(g));
        cell.title = `${hash} · ${g < 0 ? 'shared' : app.info.groups[g]}`;
        cls += ' full';
        if (added.has(c)) cls += evicted.has(c) ? ' fresh replaced' : ' fresh';
        if (current.has(hash)) cls += ' mine';
      }
      if (cell.className !== cls) cell.className = cls;
    }
    const owners = [...counts.entries()].sort((a, b) => b[1] - a[1])
      .map(([g, n]) => `${g < 0 ? 'shared' : app.info.groups[g]} ${n}`).join(', ');
    card.querySelector('.grid').setAttribute('aria-label',
      `${r.name} cache: ${r.used} of ${r.capacity} blocks${owners ? ` (${owners})` : ''}; ${evicted.size} evicted by the last request`);
    card.querySelector('.hit').textContent = r.query_tokens ? pct(r.hit_tokens / r.query_tokens) : 'n/a';
    card.querySelector('.reqs').textContent = String(r.requests);
    card.querySelector('.used').textContent = `${r.used}/${r.capacity}`;
    card.querySelector('.queue').textContent = String(r.waiting);
    const lanes = card.querySelectorAll('.lane');
    lanes.forEach((lane, l) => lane.classList.toggle('busy', l < r.running));
    card.querySelector('.lanes-num').textContent = `${r.running}/${r.lanes} busy`;
    const picked = decision && decision.endpoint === i;
    card.classList.toggle('picked', Boolean(picked));
    card.querySelector('.pick').textContent = picked ? `← #${view.step.index}` : '';
    card.title = `router believes ${r.belief_blocks} blocks are here; the cache holds ${r.used}`;
  });
}

function renderLegend() {
  const box = $('#legend');
  box.replaceChildren();
  const groups = app.info.groups;
  const shown = groups.slice(0, 16);
  for (const [g, name] of shown.entries()) {
    box.append(h('span', { class: 'key' }, h('i', { class: 'cell full', style: `--c:${groupColor(g)}` }), name));
  }
  if (groups.length > shown.length) box.append(h('span', { class: 'key muted' }, `+${groups.length - shown.length} more`));
  if (app.info.config && ['conversations', 'mixed'].includes(app.settings.trace.shape)) {
    box.append(h('span', { class: 'key' }, h('i', { class: 'cell full', style: `--c:${SHARED_COLOR}` }), 'shared'));
  }
  box.append(
    h('span', { class: 'key' }, h('i', { class: 'cell full mine', style: `--c:${PALETTE[0]}` }), 'in this request'),
    h('span', { class: 'key' }, h('i', { class: 'cell full fresh', style: `--c:${PALETTE[0]}` }), 'just cached'),
    h('span', { class: 'key' }, h('i', { class: 'cell evicted' }), 'just evicted'),
  );
}

// ---------------------------------------------------------------------------------------------
// Comparison table and chart

/** The selected policy with both beliefs; recomputed whenever the settings change. */
function scheduleBeliefs(demo, settings) {
  const key = JSON.stringify(settings);
  if (key === app.beliefsKey && app.beliefs) return;
  app.beliefsKey = key;
  app.beliefs = null;
  renderBeliefs();
  setTimeout(() => {
    if (demo !== app.demo) return;
    try {
      app.beliefs = JSON.parse(demo.beliefs());
    } catch (err) {
      app.beliefs = [];
      showError(String(err.message ?? err));
    }
    renderBeliefs();
  }, 40);
}

function renderBeliefs() {
  const body = $('#beliefs').tBodies[0];
  body.replaceChildren();
  if (!app.beliefs) {
    body.append(h('tr', {}, h('td', { colspan: '5', class: 'muted' }, 'Running both beliefs on this trace…')));
    return;
  }
  for (const row of app.beliefs) {
    const r = row.report;
    const c = row.check;
    body.append(h('tr', { dataset: { index: row.index } },
      h('th', { scope: 'row' }, row.index),
      h('td', { dataset: { metric: 'hit_rate', value: String(r.hit_rate) } }, pct(r.hit_rate)),
      h('td', { class: 'num' }, ms(r.ttft_p95_ms)),
      h('td', { class: 'num', dataset: { metric: 'wrong', value: String(c.wrong) } }, `${c.wrong} of ${c.requests}`),
      h('td', { class: 'num', dataset: { metric: 'false_hits', value: String(c.false_hits) } }, String(c.false_hits)),
    ));
  }
}

function renderCompare() {
  const body = $('#compare').tBodies[0];
  body.replaceChildren();
  const policy = app.info.config.router.policy;
  const n = app.info.requests.length;
  $('#compare-meta').textContent = `Core's simulate, in WebAssembly, on the same ${n} requests (seed ${app.settings.trace.seed}) and fleet (${app.info.replicas.length} replicas × ${app.info.config.cache_blocks} blocks, ${app.info.config.timing.lanes} lanes).`;
  if (!app.compare) {
    body.append(h('tr', {}, h('td', { colspan: '7', class: 'muted' }, 'Running every policy on this trace…')));
    return;
  }
  const best = Math.max(...app.compare.map((row) => row.report.hit_rate));
  for (const row of app.compare) {
    const r = row.report;
    const mine = row.policy === policy;
    const perReplica = h('div', { class: 'per-replica', title: r.requests_per_replica.join(' · ') });
    const peak = Math.max(...r.requests_per_replica, 1);
    for (const count of r.requests_per_replica) {
      perReplica.append(h('i', { style: `height:${Math.max(2, (18 * count) / peak)}px` }));
    }
    body.append(h('tr', { class: mine ? 'current' : '', dataset: { policy: row.policy } },
      h('th', { scope: 'row' }, h('span', { class: 'swatch', style: `--c:${POLICY_COLORS[row.policy]}` }), row.policy, mine ? h('small', { class: 'tag' }, 'selected') : null),
      h('td', { dataset: { metric: 'hit_rate', value: String(r.hit_rate) } },
        h('div', { class: 'hitbar' }, h('i', { style: `width:${best > 0 ? (100 * r.hit_rate) / Math.max(best, 1e-9) : 0}%;--c:${POLICY_COLORS[row.policy]}` })),
        h('span', {}, pct(r.hit_rate))),
      h('td', { class: 'num', dataset: { metric: 'ttft_p50', value: String(r.ttft_p50_ms) } }, ms(r.ttft_p50_ms)),
      h('td', { class: 'num', dataset: { metric: 'ttft_p95', value: String(r.ttft_p95_ms) } }, ms(r.ttft_p95_ms)),
      h('td', { class: 'num' }, String(r.queue_p95)),
      h('td', { class: 'num', dataset: { metric: 'groups_on_one' } }, `${r.groups_on_one}/${r.groups}`),
      h('td', {}, h('div', { class: 'rpr' }, perReplica, h('span', { class: 'muted' }, r.requests_per_replica.join(' · ')))),
    ));
  }
}

function renderChart() {
  const box = $('#chart');
  const W = Math.max(300, Math.round(box.clientWidth || 560));
  const H = 200;
  const pad = { l: 40, r: 12, t: 10, b: 26 };
  const n = app.info.requests.length;
  const x = (i) => pad.l + ((W - pad.l - pad.r) * (n <= 1 ? 0 : i / (n - 1)));
  const y = (v) => pad.t + (H - pad.t - pad.b) * (1 - v);
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', role: 'img', 'aria-label': 'Cumulative fleet hit rate per request for each policy' });
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    svg.append(s('line', { x1: pad.l, x2: W - pad.r, y1: y(v), y2: y(v), class: 'gridline' }));
    const label = s('text', { x: pad.l - 6, y: y(v) + 4, class: 'axis', 'text-anchor': 'end' });
    label.textContent = `${v * 100}%`;
    svg.append(label);
  }
  const xl = s('text', { x: W - pad.r, y: H - 6, class: 'axis', 'text-anchor': 'end' });
  xl.textContent = `request ${n}`;
  const x0 = s('text', { x: pad.l, y: H - 6, class: 'axis' });
  x0.textContent = 'request 1';
  svg.append(xl, x0);
  const points = (series) => series.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(' ');
  const policy = app.info.config.router.policy;
  for (const row of app.compare ?? []) {
    svg.append(s('polyline', {
      points: points(row.hit_series),
      class: `ref${row.policy === policy ? ' own' : ''}`,
      stroke: POLICY_COLORS[row.policy],
      'data-policy': row.policy,
    }));
  }
  if (app.series.length) {
    const live = s('polyline', { points: points(app.series), class: 'live', stroke: POLICY_COLORS[policy], 'data-policy': 'live' });
    svg.append(live);
    const last = app.series.length - 1;
    svg.append(s('circle', { cx: x(last), cy: y(app.series[last]), r: 4, class: 'dot', fill: POLICY_COLORS[policy] }));
  }
  box.replaceChildren(svg);
  const legend = $('#chart-legend');
  legend.replaceChildren(...(app.compare ?? []).map((row) => h('span', { class: `key${row.policy === policy ? ' own' : ''}` },
    h('i', { class: 'line', style: `--c:${POLICY_COLORS[row.policy]}` }), row.policy,
    h('small', {}, ` ${pct(row.report.hit_rate)}`))));
}

// ---------------------------------------------------------------------------------------------
// Wiring

function onKey(event) {
  const target = event.target;
  if (target instanceof HTMLElement && target.closest('input, select, textarea, [contenteditable]')) return;
  if (event.altKey || event.ctrlKey || event.metaKey) return;
  if (event.key === ' ' || event.code === 'Space') {
    if (target instanceof HTMLButtonElement || target instanceof HTMLAnchorElement) return;
    event.preventDefault();
    if (app.running) pause(); else run();
  } else if (event.key === 'ArrowRight' || event.key === 'n') {
    event.preventDefault();
    if (!app.running) stepOnce();
  } else if (event.key === 'r' || event.key === 'R') {
    event.preventDefault();
    rebuild();
  }
}

async function main() {
  await init();
  app.defaults = JSON.parse(coreDefaults());
  for (const [policy, scorers] of Object.entries(app.defaults.policy_scorers)) USED[policy] = scorers;
  for (const policy of app.defaults.predicting) PREDICTING.add(policy);
  field('policy').replaceChildren(...app.defaults.policies.map((p) => h('option', { value: p }, p)));
  field('shape').replaceChildren(...app.defaults.shapes.map((p) => h('option', { value: p }, p)));
  // The demo's limits live in the wasm crate; the inputs take them from there.
  const { limits } = app.defaults;
  for (const [name, max] of [['requests', limits.requests], ['replicas', limits.replicas],
    ['cache_blocks', limits.cache_blocks], ['tenants', limits.tenants], ['prompt_words', limits.prompt_words],
    ['question_words', limits.prompt_words], ['slots', limits.lanes]]) {
    field(name).max = String(max);
  }
  fillForm(app.defaults);
  let debounce = null;
  form.addEventListener('change', () => { clearTimeout(debounce); rebuild({ onlyIfChanged: true }); });
  form.addEventListener('input', (event) => {
    if (event.target instanceof HTMLSelectElement) return;
    clearTimeout(debounce);
    debounce = setTimeout(() => rebuild({ onlyIfChanged: true }), 400);
  });
  form.addEventListener('submit', (event) => { event.preventDefault(); rebuild(); });
  $('#defaults').addEventListener('click', () => { fillForm(app.defaults); rebuild(); });
  $('#run').addEventListener('click', run);
  $('#pause').addEventListener('click', pause);
  $('#step').addEventListener('click', () => { pause(); stepOnce(); });
  $('#reset').addEventListener('click', () => rebuild());
  $('#speed').addEventListener('change', () => { if (app.running) { pause(); run(); } });
  document.addEventListener('keydown', onKey);
  let width = 0;
  new ResizeObserver(([entry]) => {
    const w = Math.round(entry.contentRect.width);
    if (w !== width && app.info) {
      width = w;
      renderChart();
    }
  }).observe($('#chart'));
  rebuild();
  // On a narrow screen the settings start folded, so the decision is what one sees first.
  if (window.matchMedia('(max-width: 1020px)').matches) $('#settings-panel').open = false;
  document.body.dataset.ready = 'true';
}

main().catch((err) => {
  showError(`Could not start the demo: ${err.message ?? err}`);
  throw err;
});
