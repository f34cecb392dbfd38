// Two trials side by side, also from different jobs: which knobs differ, what each metric did,
// and the step-time breakdown category by category. One trial alone is shown as A only.
import { api, bytes, el, label, num, pct, seconds, showError } from "./common.js";
import * as plots from "./plots.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const FORMAT = {
  tokens_per_s: num, samples_per_s: (x) => num(x, 1), step_time_s: seconds, mfu: pct, tflops: (x) => num(x, 2),
  peak_mem_allocated_bytes: bytes, peak_mem_reserved_bytes: bytes, estimated_peak_mem_bytes: bytes,
};

function change(c, name) {
  if (c === null || c === undefined) return el("td", {}, "–");
  // Higher is better for throughput and MFU; lower is better for time and memory.
  const higherBetter = ["tokens_per_s", "samples_per_s", "mfu", "tflops"].includes(name);
  const good = higherBetter ? c > 0 : c < 0;
  return el("td", { class: c === 0 ? "" : good ? "up" : "down" }, `${c > 0 ? "+" : ""}${(c * 100).toFixed(1)}%`);
}

function who(side) {
  const hw = side.hardware;
  const count = hw.device_count ?? hw.devices ?? "?";
  const torch = hw.torch ? `, torch ${hw.torch}` : "";
  return `#${side.trial.number} of job ${side.job_id} (${side.recipe_name}, ${hw.device || "?"}×${count}${torch})`;
}

async function show(a, b) {
  $("ref-a").value = a;
  $("ref-b").value = b || "";
  if (!b) b = a;
  let data;
  try {
    data = await api(`/ui/api/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  } catch (err) {
    showError($("compare-error"), err);
    return;
  }
  $("compare-error").replaceChildren();
  $("compare-result").hidden = false;
  const head = el("tr", {}, el("th", {}, ""), el("th", {}, `A: ${who(data.a)}`), el("th", {}, `B: ${who(data.b)}`));
  const renderKnobs = () => $("compare-knobs").replaceChildren(head.cloneNode(true),
    ...data.knobs.filter((k) => k.differs || !$("only-diff").checked).map((k) =>
      el("tr", { class: k.differs ? "differs" : "", dataset: { knob: k.name } },
        el("td", {}, k.name), el("td", {}, label(k.a)), el("td", {}, label(k.b)))));
  $("only-diff").onchange = renderKnobs;
  renderKnobs();
  $("compare-metrics").replaceChildren(el("tr", {}, el("th", {}, ""), el("th", {}, "A"), el("th", {}, "B"), el("th", {}, "B vs A")),
    ...data.metrics.map((m) => el("tr", { dataset: { metric: m.name } }, el("td", {}, m.name),
      el("td", {}, (FORMAT[m.name] || num)(m.a)), el("td", {}, (FORMAT[m.name] || num)(m.b)), change(m.change, m.name))));
  const ms = (x) => (x === null || x === undefined ? "–" : `${(x * 1000).toFixed(2)} ms`);
  $("compare-breakdown").replaceChildren(el("tr", {}, el("th", {}, "category"), el("th", {}, "A"), el("th", {}, "B"), el("th", {}, "B − A")),
    ...data.breakdown.map((c) => el("tr", { dataset: { category: c.category } }, el("td", {}, c.category), el("td", {}, ms(c.a)), el("td", {}, ms(c.b)),
      el("td", {}, c.a !== null && c.b !== null ? ms(c.b - c.a) : "–"))));
  if (!data.breakdown.length) $("compare-breakdown").append(el("tr", {}, el("td", { colspan: 4, class: "muted" }, "no breakdown recorded (run with profiling)")));
  await new Promise((r) => (window.Plotly ? r() : window.addEventListener("load", r, { once: true })));
  if (data.breakdown.length) {
    await plots.breakdown($("compare-breakdown-plot"), [
      { label: `A #${data.a.trial.number}`, breakdown: data.a.trial.attrs.breakdown },
      { label: `B #${data.b.trial.number}`, breakdown: data.b.trial.attrs.breakdown },
    ]);
  }
  document.body.dataset.ready = "true";
}

$("compare-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const q = new URLSearchParams({ a: $("ref-a").value.trim() });
  if ($("ref-b").value.trim()) q.set("b", $("ref-b").value.trim());
  history.pushState(null, "", `?${q}`);
  show(q.get("a"), q.get("b"));
});

if (params.get("a")) show(params.get("a"), params.get("b"));
