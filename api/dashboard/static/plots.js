// Plotly figures from the server's aggregated series (the server already downsampled them).
const LAYOUT = { margin: { l: 60, r: 20, t: 40, b: 50 }, height: 340, legend: { orientation: "h" } };
const CATEGORIES = ["compute", "attention", "communication", "optimizer", "idle"];
const MIB = 1024 * 1024;

function draw(node, traces, layout) {
  return window.Plotly.react(node, traces, { ...LAYOUT, ...layout }, { displaylogo: false, responsive: true });
}

// The best-so-far line is the study's ranking (the server's `Ranking.improvements`): medians over
// re-measurements, loss drift and memory decide, so it ends at the trial the best card names. A
// trial's point is its first measurement; one the ranking excludes is drawn hollow.
export function history(node, h) {
  const tokens = (v) => `${Math.round(v).toLocaleString("en-US")} tokens/s`;
  const points = (keep) => {
    const idx = h.number.map((_, i) => i).filter((i) => (h.eligible ? h.eligible[i] : true) === keep);
    return { x: idx.map((i) => h.number[i]), y: idx.map((i) => h.tokens_per_s[i]), hoverinfo: "text",
      text: idx.map((i) => `#${h.number[i]}: ${tokens(h.tokens_per_s[i])}${h.note && h.note[i] ? `<br>${h.note[i]}` : ""}`) };
  };
  const traces = [
    { ...points(true), mode: "markers", name: "trial", marker: { size: 5 } },
    { x: h.number, y: h.best, mode: "lines", name: "best so far", line: { shape: "hv" }, hoverinfo: "text",
      text: h.number.map((_, i) => (h.best[i] == null ? "no eligible trial yet" : `best so far: #${h.best_trial[i]}, ${tokens(h.best[i])}`)) },
  ];
  const excluded = points(false);
  if (excluded.x.length) {
    traces.push({ ...excluded, mode: "markers", name: "cannot win", marker: { size: 6, symbol: "circle-open", color: "#6b7280" } });
  }
  if (h.failed.number.length) {
    traces.push({
      x: h.failed.number, y: h.failed.number.map(() => 0), mode: "markers", name: "failed",
      marker: { symbol: "x", color: "#d62728" },
      text: h.failed.number.map((n, i) => `#${n} ${h.failed.status[i]}: ${h.failed.error[i]}`), hoverinfo: "text",
    });
  }
  // Whole trial numbers only: a short study would otherwise get ticks at 0.5.
  const last = Math.max(0, ...h.number, ...h.failed.number);
  const xaxis = { title: { text: "trial" }, dtick: last < 10 ? 1 : undefined };
  return draw(node, traces, { title: { text: "Optimisation history" }, xaxis, yaxis: { title: { text: "tokens/s" } } });
}

export function importance(node, imp) {
  const params = [...imp.params].reverse();
  const values = [...imp.values].reverse();
  const bar = { type: "bar", orientation: "h", x: values, y: params, text: values.map((v) => v.toFixed(2)) };
  if (imp.indicative && imp.low) {
    // Asymmetric whiskers: the 10-90% range over bootstrap resamples of the trials.
    const low = [...imp.low].reverse();
    const high = [...imp.high].reverse();
    bar.error_x = { type: "data", symmetric: false, array: values.map((v, i) => Math.max(0, high[i] - v)),
      arrayminus: values.map((v, i) => Math.max(0, v - low[i])), color: "#6b7280" };
    bar.marker = { color: "#9ca3af" };
  }
  const title = imp.indicative ? `Knob importance (PED-ANOVA), indicative: ${imp.completed} trials` : "Knob importance (PED-ANOVA)";
  return draw(node, [bar], { title: { text: title }, xaxis: { title: { text: "importance for tokens/s" } }, margin: { ...LAYOUT.margin, l: 130 } });
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

// Viridis at t in [0, 1] (5 stops, interpolated): the colour of a line by its tokens/s.
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function viridis(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const c = VIRIDIS[i].map((v, k) => Math.round(v + f * (VIRIDIS[i + 1][k] - v)));
  return `rgb(${c.join(",")})`;
}

// Parallel coordinates drawn as SVG: one axis per knob (its choices in order) and tokens/s, one
// line per trial. Plotly's parcoords is a WebGL trace, seconds in a browser without a GPU, and
// it is not in the partial bundle the dashboard serves.
export function parallel(node, p) {
  const width = Math.max(520, node.clientWidth || 520);
  const height = LAYOUT.height;
  const m = { l: 50, r: 70, t: 60, b: 30 };
  const axes = [...p.dimensions.map((d) => ({ label: d.name, ticks: d.choices,
    pos: d.values.map((v) => (d.choices.length > 1 ? d.choices.indexOf(v) / (d.choices.length - 1) : 0.5)) }))];
  const lo = Math.min(...p.tokens_per_s);
  const hi = Math.max(...p.tokens_per_s);
  const norm = (v) => (hi > lo ? (v - lo) / (hi - lo) : 0.5);
  axes.push({ label: "tokens/s", ticks: [Math.round(lo).toLocaleString("en-US"), Math.round(hi).toLocaleString("en-US")],
    pos: p.tokens_per_s.map(norm) });
  const x = (i) => m.l + (i * (width - m.l - m.r)) / Math.max(1, axes.length - 1);
  const y = (t) => height - m.b - t * (height - m.t - m.b);
  const root = svg("svg", { class: "parcoords", width, height, viewBox: `0 0 ${width} ${height}` });
  root.append(svg("text", { x: m.l, y: 24, "font-size": 16 }, "Parallel coordinates (most important knobs)"));
  const order = p.tokens_per_s.map((v, i) => [v, i]).sort((a, b) => a[0] - b[0]); // best drawn last, on top
  for (const [v, i] of order) {
    const pts = axes.map((a, k) => `${x(k).toFixed(1)},${y(a.pos[i]).toFixed(1)}`).join(" ");
    const line = svg("polyline", { points: pts, fill: "none", stroke: viridis(norm(v)), "stroke-opacity": 0.6, "stroke-width": 1.2 });
    line.append(svg("title", {}, `#${p.number[i]}: ${Math.round(v).toLocaleString("en-US")} tokens/s`));
    root.append(line);
  }
  axes.forEach((a, k) => {
    root.append(svg("line", { x1: x(k), x2: x(k), y1: y(0), y2: y(1), stroke: "#374151" }));
    root.append(svg("text", { x: x(k), y: m.t - 12, "text-anchor": "middle", "font-weight": 600 }, a.label));
    const n = a.ticks.length;
    a.ticks.forEach((tick, j) => {
      root.append(svg("text", { x: x(k) + 4, y: y(n > 1 ? j / (n - 1) : 0.5) + 4 }, tick));
    });
  });
  node.replaceChildren(root);
  return Promise.resolve();
}

export function pareto(node, p) {
  const mib = (xs) => xs.map((x) => x / MIB);
  return draw(node, [
    { x: mib(p.all.peak_mem_bytes), y: p.all.tokens_per_s, mode: "markers", name: "trial", marker: { size: 5, color: "#9ecae1" },
      text: p.all.number.map((n) => `#${n}`) },
    { x: mib(p.front.peak_mem_bytes), y: p.front.tokens_per_s, mode: "lines+markers", name: "Pareto front",
      line: { shape: "hv" }, marker: { color: "#d62728" }, text: p.front.number.map((n) => `#${n}`) },
  ], { title: { text: "Pareto front: tokens/s against peak memory" }, xaxis: { title: { text: "peak memory (MiB)" } }, yaxis: { title: { text: "tokens/s" } } });
}

export function memory(node, m) {
  const groups = ["ok", "oom"].map((s) => ({ s, idx: m.status.map((x, i) => (x === s ? i : -1)).filter((i) => i >= 0) }));
  const traces = groups.filter((g) => g.idx.length).map((g) => ({
    x: g.idx.map((i) => m.estimated[i] / MIB), y: g.idx.map((i) => m.measured[i] / MIB), mode: "markers", name: g.s,
    marker: { size: 5, color: g.s === "oom" ? "#d62728" : "#1f77b4" }, text: g.idx.map((i) => `#${m.number[i]}`),
  }));
  const top = Math.max(1, ...m.estimated.map((x) => x / MIB), ...m.measured.map((x) => x / MIB));
  traces.push({ x: [0, top], y: [0, top], mode: "lines", name: "exact estimate", line: { dash: "dot", color: "#888" } });
  return draw(node, traces, { title: { text: "Peak memory: estimated vs measured" }, xaxis: { title: { text: "estimated (MiB)" } }, yaxis: { title: { text: "measured (MiB)" } } });
}

// The performance model's prediction before each trial ran against what the trial measured, one
// colour per chooser (the model, TPE while the model fitted badly, the driver's queue), whiskers
// for the predicted 90% interval, and the line of a perfect prediction.
const CHOOSERS = { model: [31, 119, 180], tpe: [255, 127, 14], queue: [107, 114, 128], unknown: [156, 163, 175] };
const rgba = (c, a) => `rgba(${c.join(",")},${a})`;
export function predictions(node, p) {
  const traces = Object.keys(CHOOSERS).map((who) => {
    const idx = p.chosen_by.map((c, i) => ((CHOOSERS[c] ? c : "unknown") === who ? i : -1)).filter((i) => i >= 0);
    const span = (i) => (Array.isArray(p.interval[i]) ? p.interval[i] : [p.predicted[i], p.predicted[i]]);
    return {
      x: idx.map((i) => p.predicted[i]), y: idx.map((i) => p.measured[i]), mode: "markers", name: `chosen by ${who}`,
      marker: { size: 6, color: rgba(CHOOSERS[who], 0.85) },
      // Faint: with hundreds of trials the intervals would otherwise hide the points.
      error_x: { type: "data", symmetric: false, array: idx.map((i) => Math.max(0, span(i)[1] - p.predicted[i])),
        arrayminus: idx.map((i) => Math.max(0, p.predicted[i] - span(i)[0])), color: rgba(CHOOSERS[who], 0.15), thickness: 1, width: 0 },
      text: idx.map((i) => `#${p.number[i]}: predicted ${Math.round(p.predicted[i]).toLocaleString("en-US")}, measured ${Math.round(p.measured[i]).toLocaleString("en-US")}`),
      hoverinfo: "text",
    };
  }).filter((t) => t.x.length);
  const all = [...p.predicted, ...p.measured];
  const lo = Math.min(...all) * 0.9;
  const hi = Math.max(...all) * 1.1;
  traces.push({ x: [lo, hi], y: [lo, hi], mode: "lines", name: "predicted = measured", line: { dash: "dot", color: "#888" }, hoverinfo: "skip" });
  return draw(node, traces, { title: { text: "Predicted vs measured tokens/s" }, xaxis: { title: { text: "predicted before the run (tokens/s)" } },
    yaxis: { title: { text: "measured (tokens/s)" } }, legend: { orientation: "h", y: -0.3 }, margin: { ...LAYOUT.margin, b: 90 }, height: 380 });
}

// Stacked bars of step time by category, one bar per trial (best card and comparison).
export function breakdown(node, bars) {
  const cats = [...CATEGORIES, ...new Set(bars.flatMap((b) => Object.keys(b.breakdown || {})).filter((c) => !CATEGORIES.includes(c)))];
  const traces = cats.map((c) => ({
    type: "bar", orientation: "h", name: c, y: bars.map((b) => b.label),
    x: bars.map((b) => ((b.breakdown || {})[c] || 0) * 1000),
  }));
  return draw(node, traces, { barmode: "stack", title: { text: "Step time breakdown" }, xaxis: { title: { text: "ms per step" } },
    height: 120 + 50 * bars.length, margin: { ...LAYOUT.margin, l: 90 } });
}
