// The jobs page: every job with its progress, filtered by state and paged newest first, and the
// recipe submission form with the models a recipe can name.
import { api, age, badge, el, num, showError } from "./common.js";
import { loadModels } from "./models.js";

const REFRESH_MS = 3000;
const stateFilter = document.getElementById("state-filter");
const tbody = document.querySelector("#jobs-table tbody");
const status = document.getElementById("jobs-status");

// Studies no job of this service ran (`tuner tune` on the same database, the nightly): each
// opens the same page as a job's, read by study name.
const studiesBody = document.querySelector("#studies-table tbody");
const studiesStatus = document.getElementById("studies-status");

async function loadStudies() {
  try {
    const page = await api("/v1/studies");
    const others = page.items.filter((s) => !s.job_ids.length);
    studiesBody.replaceChildren(...others.map((s) => el("tr", { dataset: { study: s.name, source: s.source } },
      el("td", {}, el("a", { href: s.links.page }, s.recipe_name)),
      el("td", {}, s.source === "cli" ? "tuner tune" : s.source),
      el("td", { class: "num" }, num(s.finished)),
      el("td", { class: "num" }, num(s.best_tokens_per_s)),
      el("td", {}, age(s.last_change)),
      el("td", { class: "muted" }, s.name))));
    studiesStatus.textContent = others.length ? "" : "Every study in this database belongs to a job above.";
  } catch (err) {
    showError(studiesStatus, err);
  }
}

// The table holds the newest jobs of the filter down to `oldest` (the oldest job id shown; null:
// the first page only); "Show older jobs" follows the last page's cursor and appends. A refresh
// reads that same span again from the top, so jobs submitted meanwhile land above, the appended
// pages stay and stay live (a page of /v1/jobs per 200 jobs shown, each refresh).
const PAGE_SIZE = 200; // the most one page of /v1/jobs holds
const shownLine = document.getElementById("jobs-shown");
const olderButton = document.getElementById("jobs-older");
const shown = { state: null, jobs: [], next: null, oldest: null };

// One load at a time, in order: a refresh that follows "show older" reads the span it extended.
let pending = Promise.resolve();
let refreshWaiting = false;
const inTurn = (task) => (pending = pending.then(task).catch((err) => showError(status, err)));

function refresh() {
  if (refreshWaiting) return; // the one waiting reads everything shown when its turn comes
  refreshWaiting = true;
  inTurn(() => { refreshWaiting = false; return loadJobs(); });
}

function readPage(state, cursor) {
  const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (state) query.set("state", state);
  if (cursor) query.set("cursor", cursor);
  return api(`/v1/jobs?${query}`);
}

// The newest jobs down to `oldest` (one page when null), and the cursor of the page below them.
async function readDownTo(state, oldest) {
  const jobs = [];
  let next = null;
  do {
    const page = await readPage(state, next);
    jobs.push(...page.items);
    next = page.next_cursor;
  } while (next && oldest !== null && Number(next) > oldest);
  if (oldest === null) return { jobs, next };
  const kept = jobs.filter((j) => j.id >= oldest);
  return { jobs: kept, next: kept.length < jobs.length ? String(oldest) : next }; // a cursor: ids below it
}

async function loadJobs() {
  const state = stateFilter.value;
  const oldest = state === shown.state ? shown.oldest : null; // another filter starts from its newest
  try {
    const { jobs, next } = await readDownTo(state, oldest);
    render(state, jobs, next, oldest);
  } catch (err) {
    showError(status, err);
  }
}

async function loadOlder() {
  if (stateFilter.value !== shown.state || !shown.next) return loadJobs();
  olderButton.disabled = true;
  try {
    const page = await readPage(shown.state, shown.next);
    const jobs = [...shown.jobs, ...page.items];
    render(shown.state, jobs, page.next_cursor, jobs.length ? jobs[jobs.length - 1].id : null);
  } catch (err) {
    olderButton.disabled = false;
    showError(status, err);
  }
}

function render(state, jobs, next, oldest) {
  Object.assign(shown, { state, jobs, next, oldest });
  tbody.replaceChildren(...jobs.map(jobRow));
  const what = state ? `${state} jobs` : "jobs";
  status.textContent = jobs.length ? "" : state ? `No ${what}.` : "No jobs yet: submit a recipe below.";
  if (!jobs.length) shownLine.textContent = "";
  else if (next) shownLine.textContent = `Showing the newest ${num(jobs.length)} ${what}; older ones are not shown yet.`;
  else shownLine.textContent = `Showing all ${num(jobs.length)} ${what}.`;
  olderButton.hidden = !next;
  olderButton.disabled = false;
  document.body.dataset.loaded = "true";
}

function jobRow(job) {
  const total = job.trials_total || 0;
  return el("tr", { dataset: { jobId: job.id, state: job.state } },
    el("td", {}, el("a", { href: `/ui/jobs/${job.id}` }, `#${job.id}`)),
    el("td", {}, el("a", { href: `/ui/recipes/${encodeURIComponent(job.history_name)}` }, job.name)),
    el("td", {}, badge(job.state)),
    el("td", { class: "progress" }, el("progress", { max: total || 1, value: job.trials_done }), ` ${job.progress}`),
    el("td", { class: "num" }, num(job.best_tokens_per_s)),
    el("td", { class: "num" }, job.speedup ? `${job.speedup.toFixed(2)}×` : "–"),
    el("td", {}, age(job.created_at)));
}

// Form: the API answers 422 with errors [{field, message}]; each goes next to the recipe text,
// with the line where that field sits in the YAML when it can be found.
const form = document.getElementById("recipe-form");
const text = document.getElementById("recipe-text");
const errors = document.getElementById("recipe-errors");
const result = document.getElementById("recipe-result");

document.getElementById("recipe-file").addEventListener("change", async (ev) => {
  const file = ev.target.files[0];
  if (file) text.value = await file.text();
});

function lineOf(field) {
  const key = String(field).split(".").filter((p) => !/^\d+$/.test(p)).pop();
  if (!key) return null;
  const lines = text.value.split("\n");
  const re = new RegExp(`(^|[\\s{,])"?${key.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}"?\\s*:`);
  const i = lines.findIndex((line) => re.test(line));
  return i >= 0 ? i + 1 : null;
}

form.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  errors.replaceChildren();
  text.removeAttribute("aria-invalid");
  result.textContent = "Submitting…";
  try {
    const job = await api("/v1/jobs", {
      method: "POST",
      headers: { "Content-Type": "application/yaml" },
      body: text.value,
    });
    result.replaceChildren("Queued ", el("a", { id: "new-job-link", href: `/ui/jobs/${job.id}` }, `job #${job.id}`));
    refresh();
  } catch (err) {
    result.textContent = err.message;
    text.setAttribute("aria-invalid", "true");
    const items = err.errors.length ? err.errors : [{ field: "", message: err.message }];
    errors.replaceChildren(...items.map(({ field, message }) => {
      const line = field ? lineOf(field) : null;
      return el("li", { class: "field-error", dataset: { field } },
        field ? el("code", {}, field) : null, field ? ": " : "", message,
        line ? el("span", { class: "muted" }, ` (line ${line})`) : null);
    }));
  }
});

stateFilter.addEventListener("change", refresh);
olderButton.addEventListener("click", () => inTurn(loadOlder));
refresh();
loadStudies();
loadModels(text, result);
setInterval(refresh, REFRESH_MS);
setInterval(loadStudies, 5 * REFRESH_MS);
