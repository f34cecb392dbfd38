// Plotly figures from the server's aggregated series (the server already downsampled them).
const LAYOUT = { margin: { l: 60, r: 20, t: 40, b: 50 }, height: 340, legend: { orientation: "h" } };
const CATEGORIES = ["compute", "attention", "communication", "optimizer", "idle"];
const MIB = 1024 * 1024;

function draw(node, traces, layout) {
  return window.Plotly.react(node, traces, { ...LAYOUT, ...layout }, { displaylogo: false, responsive: true });
}

export function history(node, h) {
  const traces = [
    { x: h.number, y: h.tokens_per_s, mode: "markers", name: "trial", marker: { size: 5 } },
    { x: h.number, y: h.best, mode: "lines", name: "best so far", line: { shape: "hv" } },
  ];
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
  return draw(node, [{ type: "bar", orientation: "h", x: values, y: params, text: values.map((v) => v.toFixed(2)) }],
    { title: { text: "Knob importance (PED-ANOVA)" }, xaxis: { title: { text: "importance for tokens/s" } }, margin: { ...LAYOUT.margin, l: 130 } });
}

export function parallel(node, p) {
  const dims = p.dimensions.map((d) => ({
    label: d.name,
    values: d.values.map((v) => d.choices.indexOf(v)),
    tickvals: d.choices.map((_, i) => i),
    ticktext: d.choices,
  }));
  dims.push({ label: "tokens/s", values: p.tokens_per_s });
  return draw(node, [{ type: "parcoords", line: { color: p.tokens_per_s, colorscale: "Viridis", showscale: true }, dimensions: dims }],
    { title: { text: "Parallel coordinates (most important knobs)" }, margin: { l: 60, r: 60, t: 70, b: 30 } });
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
