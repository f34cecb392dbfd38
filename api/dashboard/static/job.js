// The job page: best config, trials table (paged on the server), plots and failures, kept live
// by the job's server-sent events (read with fetch so the token travels as a header).
import { api, authHeaders, badge, bytes, el, label, num, pct, seconds, showError } from "./common.js";
import * as plots from "./plots.js";

// A REST job (/ui/jobs/ID) or a study with no job (/ui/studies/NAME: a `tuner tune` run, a
// nightly): the same page, its data read by job id or by study name.
const [, kind, ref] = location.pathname.split("/").filter(Boolean);
const isJob = kind === "jobs";
const jobId = isJob ? Number(ref) : null;
const BASE = isJob ? `/ui/api/jobs/${jobId}` : `/ui/api/studies/${encodeURIComponent(ref)}`;
// Comparison refers to trials as JOB:TRIAL, so it is offered on a job's page only.
const compareHref = (n) => (isJob ? `/ui/compare?a=${jobId}:${n}` : null);
// Read by the browser tests and the load benchmark: set once the table and plots first rendered.
const dash = (window.__dashboard = { ready: false, tableReady: false, plotsReady: false, events: 0, refreshes: 0, timings: {} });
// Milliseconds since navigation start at which each step first finished (for the load benchmark).
const mark = (name) => { if (!(name in dash.timings)) dash.timings[name] = Math.round(performance.now()); };
const view = { page: 1, size: 50, sort: "number", statuses: new Set(), knobs: new Map(), selected: new Set() };
const $ = (id) => document.getElementById(id);
let overview = null;

const COLUMNS = [
  ["number", "#", (t) => (isJob ? el("a", { href: compareHref(t.number) }, t.number) : String(t.number))],
  ["status", "Status", (t) => { const b = badge(t.status); if (t.error) b.title = t.error; return b; }],
  ["tokens_per_s", "tokens/s", (t) => num(t.tokens_per_s)],
  ["mfu", "MFU", (t) => pct(t.mfu)],
  ["peak_mem_allocated_bytes", "Peak mem", (t) => bytes(t.peak_mem_allocated_bytes)],
  ["estimated_peak_mem_bytes", "Est. mem", (t) => bytes(t.estimated_peak_mem_bytes)],
  ["step_time_s", "Step", (t) => seconds(t.step_time_s)],
  ["duration_s", "Duration", (t) => seconds(t.duration_s)],
  // Where it ran: the host, or how many nodes a trial over several machines spanned.
  ["node", "Where", (t) => (t.nodes > 1 ? `${t.nodes} nodes` : t.node ?? "–")],
];

function markReady() {
  if (dash.tableReady && dash.plotsReady && !dash.ready) {
    dash.ready = true;
    dash.readyAt = performance.now();
    document.body.dataset.ready = "true";
  }
}

async function loadOverview() {
  try {
    overview = await api(`${BASE}/overview`);
  } catch (err) {
    showError($("job-header"), err);
    return;
  }
  const { job, best, speedup, build, failures } = overview;
  document.title = isJob ? `#${job.id} ${job.name} · tuner` : `${job.name} (study) · tuner`;
  const recipe = el("a", { href: `/ui/recipes/${encodeURIComponent(job.history_name)}` }, job.name);
  $("job-header").replaceChildren(...[
    el("h1", {}, isJob ? `Job #${job.id}: ` : "Study: ", recipe, " ", badge(job.state)),
    isJob ? null : el("p", { class: "muted" }, `${job.study_name} · not a job of this service (run by tuner tune or the nightly)`),
    // The speedup shows while the job runs: the ranking's best over the baseline, as on the best card.
    el("p", {}, el("progress", { max: job.trials_total || 1, value: job.trials_done }), " trials ", el("span", { id: "job-progress" }, job.progress),
      ` · best ${num(job.best_tokens_per_s)} tokens/s · speedup `, el("strong", { id: "job-speedup" }, speedup ? `${speedup.toFixed(2)}×` : "–"), " over the default config"),
    job.error ? errorLine(job) : null].filter(Boolean));
  renderBest(best, speedup, build, job);
  renderFailures(failures);
}

// A failed job: its one-line error, and its full log one click away (GET /v1/jobs/ID/log).
function errorLine(job) {
  if (!job.links.log) return el("p", { id: "job-error", class: "error" }, job.error);
  const box = el("pre", { id: "job-log", class: "log", hidden: true });
  const link = el("a", { id: "job-log-link", href: job.links.log, onclick: async (ev) => {
    ev.preventDefault();
    if (!box.hidden) { box.hidden = true; return; }
    try {
      box.textContent = (await api(job.links.log)).log;
    } catch (err) {
      box.textContent = err.message;
    }
    box.hidden = false;
  } }, "full log");
  return el("div", {}, el("p", { id: "job-error", class: "error" }, job.error, " · ", link), box);
}

function renderBest(best, speedup, build, job) {
  const card = $("best-card");
  card.hidden = !best;
  if (!best) return;
  $("best-summary").replaceChildren(
    el("strong", { id: "best-tokens" }, `${num(best.tokens_per_s)} tokens/s`), " ",
    best.interval == null
      ? el("span", { id: "best-interval", class: "muted", title: "the larger of the spread over its measurements and within its steps" },
        `± ${pct(best.noise)}`)
      : el("span", { id: "best-interval", class: "muted", title: "95% interval: its steps' interval and the run-to-run noise, over its runs" },
        `± ${pct(best.interval)}`), " · trial ",
    isJob ? el("a", { href: compareHref(best.number) }, `#${best.number}`) : `#${best.number}`,
    " · speedup ", el("strong", { id: "best-speedup" }, speedup ? `${speedup.toFixed(2)}×` : "–"),
    " over the default config · MFU ", pct(best.mfu), " · peak ", bytes(best.peak_mem_allocated_bytes));
  $("best-knobs").replaceChildren(...Object.entries(best.params).sort().map(([k, v]) =>
    el("tr", {}, el("th", {}, k), el("td", {}, label(v)))));
  const button = $("download-build");
  button.disabled = !build.ready;
  button.dataset.sha256 = build.sha256 || "";
  button.dataset.url = build.url;
  $("build-status").textContent = build.ready
    ? `${bytes(build.size_bytes)} · sha256 ${build.sha256.slice(0, 12)}…`
    : !isJob ? "no build: make one with tuner build RECIPE"
    : ["succeeded", "failed", "cancelled"].includes(job.state) ? "no build for this job" : "the build is made when the job succeeds";
  const bd = best.attrs.breakdown;
  $("breakdown-plot").hidden = !bd;
  $("breakdown-note").hidden = Boolean(bd);
  if (bd && window.Plotly) plots.breakdown($("breakdown-plot"), [{ label: `#${best.number}`, breakdown: bd }]);
}

async function sha256Hex(buffer) {
  const digest = await crypto.subtle.digest("SHA-256", buffer);
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join("");
}

// Download through fetch (the token is a header), check the sha256, then hand the file over.
$("download-build").addEventListener("click", async () => {
  const status = $("build-status");
  status.textContent = "downloading…";
  try {
    const res = await fetch($("download-build").dataset.url, { headers: authHeaders() });
    if (!res.ok) throw new Error((await res.json()).detail);
    const data = await res.arrayBuffer();
    const expected = res.headers.get("X-Checksum-Sha256") || $("download-build").dataset.sha256;
    const actual = await sha256Hex(data);
    if (expected && actual !== expected) throw new Error(`checksum mismatch: got ${actual}, expected ${expected}`);
    const name = (res.headers.get("content-disposition") || "").match(/filename="?([^";]+)"?/)?.[1] || "build.tar.gz";
    const link = el("a", { href: URL.createObjectURL(new Blob([data])), download: name });
    document.body.append(link);
    link.click();
    link.remove();
    status.textContent = `downloaded ${name}, sha256 verified: ${actual}`;
    status.dataset.verified = actual;
  } catch (err) {
    status.textContent = `download failed: ${err.message}`;
  }
});

function renderFailures(failures) {
  const box = $("failures");
  if (!failures.total) {
    box.replaceChildren(el("p", { class: "muted" }, "No failed trials."));
    return;
  }
  box.replaceChildren(
    el("p", { class: "muted" }, `${failures.total} failed (latest ${failures.items.length} shown)`),
    ...failures.items.map((t) => el("details", { class: "failure", dataset: { number: t.number } },
      el("summary", {}, `#${t.number} `, badge(t.status), ` ${t.error || ""}`),
      el("pre", {}, t.attrs.log_tail || "(no log captured)"))));
}

async function loadTable() {
  const q = new URLSearchParams({ page: view.page, size: view.size, sort: view.sort });
  view.statuses.forEach((s) => q.append("status", s));
  view.knobs.forEach((v, k) => q.append("knob", `${k}:${v}`));
  let data;
  try {
    data = await api(`${BASE}/trials?${q}`);
  } catch (err) {
    showError($("page-info"), err);
    tableDrawn();
    return;
  }
  if (view.page > data.pages) {
    view.page = data.pages;
    return loadTable();
  }
  const knobs = Object.keys(data.knobs).filter((k) => data.knobs[k].length > 1);
  renderHead(knobs);
  $("trials-table").querySelector("tbody").replaceChildren(...data.items.map((t) =>
    el("tr", { dataset: { number: t.number, status: t.status } },
      el("td", {}, el("input", { type: "checkbox", class: "pick", checked: view.selected.has(t.number),
        onchange: (ev) => pick(t.number, ev.target.checked) })),
      ...COLUMNS.map(([, , cell]) => el("td", {}, cell(t))),
      ...knobs.map((k) => el("td", {}, label(t.params[k]))))));
  $("page-info").textContent = `page ${data.page} of ${data.pages} · ${num(data.total)} of ${num(data.total_all)} trials`;
  $("page-prev").disabled = data.page <= 1;
  $("page-next").disabled = data.page >= data.pages;
  renderFilters(data);
  mark("table");
  tableDrawn();
  dash.tableReady = true;
  markReady();
}

function renderHead(knobs) {
  const head = (key, text) => {
    const active = view.sort.replace("-", "") === key;
    const arrow = active ? (view.sort.startsWith("-") ? " ▼" : " ▲") : "";
    return el("th", { class: "sortable", dataset: { sort: key }, onclick: () => {
      view.sort = active && !view.sort.startsWith("-") ? `-${key}` : key;
      view.page = 1;
      loadTable();
    } }, text + arrow);
  };
  $("trials-table").querySelector("thead").replaceChildren(el("tr", {}, el("th", {}, ""),
    ...COLUMNS.map(([key, text]) => head(key, text)), ...knobs.map((k) => head(k, k))));
}

function renderFilters(data) {
  const box = $("status-filter");
  const counts = data.status_counts;
  box.replaceChildren(el("legend", {}, "Status"), ...Object.keys(counts).sort().map((s) =>
    el("label", {}, el("input", { type: "checkbox", value: s, checked: view.statuses.has(s), onchange: (ev) => {
      ev.target.checked ? view.statuses.add(s) : view.statuses.delete(s);
      view.page = 1;
      loadTable();
    } }), ` ${s} (${counts[s]})`)));
  const names = $("knob-name");
  if (names.options.length !== Object.keys(data.knobs).length) {
    names.replaceChildren(...Object.keys(data.knobs).map((k) => el("option", {}, k)));
    names.onchange = () => fillValues(data.knobs);
    fillValues(data.knobs);
  }
  $("knob-chips").replaceChildren(...[...view.knobs].map(([k, v]) => el("button", { type: "button", class: "chip",
    title: "remove filter", onclick: () => { view.knobs.delete(k); view.page = 1; loadTable(); } }, `${k}=${v} ✕`)));
}

function fillValues(knobs) {
  const name = $("knob-name").value;
  $("knob-value").replaceChildren(...(knobs[name] || []).map((v) => el("option", {}, v)));
}

$("knob-add").addEventListener("click", () => {
  if (!$("knob-name").value) return;
  view.knobs.set($("knob-name").value, $("knob-value").value);
  view.page = 1;
  loadTable();
});
$("page-prev").addEventListener("click", () => { view.page -= 1; loadTable(); });
$("page-next").addEventListener("click", () => { view.page += 1; loadTable(); });
$("page-size").addEventListener("change", (ev) => { view.size = Number(ev.target.value); view.page = 1; loadTable(); });

function pick(number, on) {
  on ? view.selected.add(number) : view.selected.delete(number);
  const chosen = [...view.selected].slice(-2);
  const link = $("compare-link");
  link.hidden = !isJob || chosen.length !== 2;
  if (chosen.length === 2) link.href = `/ui/compare?a=${jobId}:${chosen[0]}&b=${jobId}:${chosen[1]}`;
}

let lastParallel = null;

// Parallel coordinates is Plotly's one WebGL trace: seconds in a browser without a GPU (software
// GL), and it blocks the page's only thread. It is drawn once the rest of the page is up.
async function drawParallel() {
  if (lastParallel && lastParallel.number.length > 1) {
    await plots.parallel($("plot-parallel"), lastParallel);
    mark("parallel_drawn");
  }
}

async function loadPlots() {
  let data;
  try {
    data = await api(`${BASE}/plots`);
  } catch (err) {
    showError($("plots-note"), err);
    return;
  }
  mark("plots_data");
  try {
    await plotlyLoaded;
  } catch (err) {
    showError($("plots-note"), err);
    return;
  }
  mark("plotly_loaded");
  const jobs = [];
  if (data.history && data.history.number.length + data.history.failed.number.length) jobs.push(plots.history($("plot-history"), data.history));
  $("plot-importance").querySelector("p.muted")?.remove();
  if (data.importance && data.importance.params.length) jobs.push(plots.importance($("plot-importance"), data.importance));
  else $("plot-importance").replaceChildren(el("p", { class: "muted" }, "Knob importance appears after 4 completed trials."));
  importanceNote(data.importance);
  if (data.pareto && data.pareto.all.number.length) jobs.push(plots.pareto($("plot-pareto"), data.pareto));
  if (data.memory && data.memory.number.length) jobs.push(plots.memory($("plot-memory"), data.memory));
  if (data.predictions && data.predictions.sampled) jobs.push(plots.predictions($("plot-predicted"), data.predictions));
  predictionsNote(data.predictions);
  await Promise.all(jobs);
  $("plots-note").textContent = data.total > data.sampled
    ? `Plots show ${num(data.sampled)} of ${num(data.total)} trials (every improvement and failure kept).` : "";
  if (overview && overview.best && overview.best.attrs.breakdown) {
    plots.breakdown($("breakdown-plot"), [{ label: `#${overview.best.number}`, breakdown: overview.best.attrs.breakdown }]);
  }
  mark("plots_drawn");
  dash.plotsReady = true;
  markReady();
  lastParallel = data.parallel;
}

// Below 20 completed trials the knobs' order is a hint, not a finding: say so, with the spread.
function importanceNote(imp) {
  const note = $("importance-note");
  note.hidden = !(imp && imp.indicative && imp.params.length);
  if (note.hidden) return;
  note.textContent = `Indicative only: importance from ${imp.completed} completed trials (reliable from ${imp.min_trials}). `
    + `Whiskers: the 10–90% range over ${imp.resamples} bootstrap resamples of the trials.`;
}

// How far the model's predictions (made before each trial ran) missed, over every predicted trial.
function predictionsNote(p) {
  const note = $("predicted-note");
  if (!p || !p.total) {
    note.textContent = "No predictions: no trial of this study was chosen with the performance model "
      + "(search.sampler: model, the default, records one before each run).";
    return;
  }
  const inside = p.inside_interval === null || p.inside_interval === undefined ? ""
    : `; ${pct(p.inside_interval, 0)} measured inside the predicted 90% interval`;
  const shown = p.sampled < p.total ? ` (the plot shows ${num(p.sampled)})` : "";
  note.textContent = `Median |predicted / measured − 1|: ${pct(p.median_error)} over ${num(p.total)} trials${inside}${shown}.`;
}

// The plan is fitted on the server to the study's own trials (a second or two for a large study),
// so it is asked for once the page is up, and again at most every PLAN_EVERY_MS while trials arrive.
const PLAN_EVERY_MS = 30_000;
let planAt = -Infinity;

function studyCell(s) {
  if (!s) return el("td", { class: "muted" }, "not tried");
  const trial = isJob ? el("a", { href: compareHref(s.trial) }, `#${s.trial}`) : `#${s.trial}`;
  if (s.tokens_per_s !== null && s.tokens_per_s !== undefined) {
    const place = s.study_rank ? ` · the study's #${s.study_rank}` : s.note ? ` · ${s.note}` : "";
    return el("td", {}, `${num(s.tokens_per_s)} tokens/s in `, trial, place);
  }
  const b = badge(s.status);
  if (s.note) b.title = s.note;
  return el("td", {}, b, " in ", trial, s.note ? el("span", { class: "muted" }, ` ${s.note}`) : null);
}

function renderPlan(plan) {
  const table = $("plan-table");
  if (!plan.available) {
    $("plan-basis").textContent = `No plan: ${plan.reason}.`;
    $("plan-best").replaceChildren();
    table.querySelector("thead").replaceChildren();
    table.querySelector("tbody").replaceChildren();
    return;
  }
  $("plan-basis").textContent = `A prediction, no device run: ${num(plan.considered)} feasible configs ranked, ${plan.basis} (${plan.seconds.toFixed(1)} s).`;
  const best = plan.study_best;
  const measured = plan.rows.filter((r) => r.study && r.study.tokens_per_s !== null && r.study.tokens_per_s !== undefined).length;
  $("plan-best").replaceChildren(...(best ? [
    "The study's best, ", el("strong", {}, `#${best.trial}`), ` at ${num(best.tokens_per_s)} tokens/s, is `,
    el("strong", { id: "plan-best-rank" }, best.plan_rank ? `the plan's #${best.plan_rank}` : "not among the plan's feasible configs"),
    best.predicted_tokens_per_s ? ` (predicted ${num(best.predicted_tokens_per_s)})` : "",
    `. The study measured ${measured} of the plan's top ${plan.rows.length}.`] : ["The study has no measured winner yet."]));
  table.querySelector("thead").replaceChildren(el("tr", {}, ...["Plan #", "Config", "Predicted tokens/s (90%)", "P(fit)", "What the study measured"]
    .map((h) => el("th", {}, h))));
  table.querySelector("tbody").replaceChildren(...plan.rows.map((r) => el("tr", { dataset: { rank: r.rank, tried: r.study ? "yes" : "no" } },
    el("td", {}, String(r.rank)), el("td", {}, r.label),
    el("td", { class: "num" }, `${num(r.tokens_per_s)} (${num(r.tokens_per_s_interval[0])}–${num(r.tokens_per_s_interval[1])})`),
    el("td", { class: "num" }, r.p_fit.toFixed(2)), studyCell(r.study))));
}

async function loadPlan() {
  planAt = performance.now();
  try {
    renderPlan(await api(`${BASE}/plan`));
  } catch (err) {
    showError($("plan-basis"), err);
  }
  mark("plan_drawn");
  dash.planReady = true;
}

// Plotly runs once the first table page is drawn (or failed), so the table shows first.
let tableDrawn;
const firstTable = new Promise((resolve) => (tableDrawn = resolve));
const plotlyLoaded = firstTable.then(() => new Promise((resolve, reject) => {
  if (window.Plotly) return resolve();
  const script = el("script", { src: "/ui/static/plotly.min.js" });
  script.onload = resolve;
  script.onerror = () => reject(new Error("could not load /ui/static/plotly.min.js"));
  document.head.append(script);
}));

// At most one refresh per second: each re-reads a changed study on the server.
const REFRESH_MS = 1000;
let pending = null;
function refreshSoon() {
  // Events can arrive in bursts (several trials finishing at once): refresh once per burst.
  if (pending) return;
  pending = setTimeout(async () => {
    pending = null;
    await Promise.all([loadOverview(), loadTable(), loadPlots()]);
    await drawParallel();
    if (performance.now() - planAt >= PLAN_EVERY_MS) await loadPlan();
    dash.refreshes += 1;
  }, REFRESH_MS);
}

// Server-sent events over fetch: EventSource cannot send the Authorization header.
async function follow() {
  if (!isJob) return pollStudy();
  let last = 0;
  for (let attempt = 0; attempt < 1000; attempt += 1) {
    $("live-status").textContent = "live: connected";
    try {
      const res = await fetch(`/v1/jobs/${jobId}/events?after=${last}`, { headers: authHeaders() });
      if (!res.ok) throw new Error(`events: HTTP ${res.status}`);
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const frame = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const id = frame.match(/^id: (\d+)/m);
          const kind = frame.match(/^event: (\S+)/m);
          if (id) last = Number(id[1]);
          if (kind) {
            dash.events += 1;
            dash.lastEvent = kind[1];
            if (kind[1] === "done") planAt = -Infinity; // the finished study's plan, whatever its age
            refreshSoon();
            if (kind[1] === "done") {
              $("live-status").textContent = "job finished";
              return;
            }
          }
        }
      }
      // The server ends the stream only when the job is final.
      $("live-status").textContent = "job finished";
      return;
    } catch (err) {
      $("live-status").textContent = `live: reconnecting (${err.message})`;
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
}

// A study run from the CLI has no events: while it has a running trial, re-read it every 5 s.
async function pollStudy() {
  while (overview && overview.job.state === "running") {
    $("live-status").textContent = "live: a trial is running (refreshed every 5 s)";
    await new Promise((r) => setTimeout(r, 5000));
    refreshSoon();
  }
  $("live-status").textContent = "";
}

await Promise.all([loadOverview(), loadTable(), loadPlots()]);
follow();
await drawParallel();
await loadPlan();
