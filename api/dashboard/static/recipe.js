// A recipe's nightly history: best tokens/s per night, regressions marked, and the fingerprint
// changes (torch, driver, device) that coincide with them.
import { api, el, num, showError } from "./common.js";

const $ = (id) => document.getElementById(id);
// Everything after /recipes/: a recipe name may hold a slash (sent as %2F, which the path keeps).
const name = decodeURIComponent(location.pathname.replace(/^.*?\/recipes\//, "").replace(/\/+$/, ""));
$("recipe-title").textContent = `Nightly history: ${name}`;

function changesText(changes) {
  return changes.map((c) => `${c.key} ${c.before ?? "–"} → ${c.after ?? "–"}`).join(", ");
}

async function main() {
  let data;
  try {
    data = await api(`/ui/api/recipes/${encodeURIComponent(name)}/history`);
  } catch (err) {
    showError($("recipe-summary"), err);
    return;
  }
  const nights = data.nights;
  $("recipe-summary").textContent = nights.length
    ? `${nights.length} nights, ${data.regressions} regression(s).`
    : "No nightly runs recorded for this recipe yet (see `tuner nightly`).";
  $("nightly-table").replaceChildren(
    el("tr", {}, ...["Night", "Best tokens/s", "Change", "Verdict", "Fingerprint changes"].map((h) => el("th", {}, h))),
    ...[...nights].reverse().map((n) => el("tr", { class: n.regression ? "regression" : "", dataset: { night: n.night } },
      el("td", {}, n.night), el("td", { class: "num" }, num(n.best_tokens_per_s)),
      el("td", { class: "num" }, n.change_pct === null ? "–" : `${n.change_pct > 0 ? "+" : ""}${n.change_pct.toFixed(1)}%`),
      el("td", {}, n.verdict),
      el("td", { class: n.suspects.length ? "error" : "" }, changesText(n.changes)))));
  if (!nights.length) return;
  await new Promise((r) => (window.Plotly ? r() : window.addEventListener("load", r, { once: true })));
  const regress = nights.filter((n) => n.regression);
  const changed = nights.filter((n) => n.changes.length);
  await window.Plotly.react($("nightly-plot"), [
    { x: nights.map((n) => n.night), y: nights.map((n) => n.best_tokens_per_s), mode: "lines+markers", name: "best tokens/s" },
    { x: regress.map((n) => n.night), y: regress.map((n) => n.best_tokens_per_s), mode: "markers", name: "regression",
      marker: { color: "#d62728", size: 12, symbol: "triangle-down" }, text: regress.map((n) => changesText(n.changes) || "no fingerprint change") },
    { x: changed.map((n) => n.night), y: changed.map((n) => n.best_tokens_per_s), mode: "markers", name: "fingerprint changed",
      marker: { color: "rgba(0,0,0,0)", size: 18, line: { color: "#f59e0b", width: 2 } }, text: changed.map((n) => changesText(n.changes)) },
  ], { title: { text: "Best tokens/s per nightly run" }, height: 360, margin: { l: 60, r: 20, t: 40, b: 50 }, yaxis: { title: { text: "tokens/s" } } },
  { displaylogo: false, responsive: true });
  document.body.dataset.ready = "true";
}

main();
