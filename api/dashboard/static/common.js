// Shared by every dashboard page: API calls that carry the stored token, the token prompt,
// small DOM and number-formatting helpers.

const TOKEN_KEY = "tuner.token";

export function storedToken() {
  return localStorage.getItem(TOKEN_KEY) || "";
}

export function authHeaders(extra = {}) {
  const token = storedToken();
  return token ? { ...extra, Authorization: `Bearer ${token}` } : { ...extra };
}

export class ApiError extends Error {
  constructor(status, body) {
    super(typeof body === "object" && body ? body.detail || `HTTP ${status}` : `HTTP ${status}`);
    this.status = status;
    this.errors = (body && body.errors) || [];
  }
}

// fetch() with the token; on 401/403 ask for a token once and retry.
export async function api(path, options = {}) {
  for (;;) {
    const res = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
    if ((res.status === 401 || res.status === 403) && (await askToken(res.status))) continue;
    const isJson = (res.headers.get("content-type") || "").includes("json");
    const body = isJson ? await res.json() : await res.text();
    if (!res.ok) throw new ApiError(res.status, body);
    return body;
  }
}

let pendingAsk = null;

// The token dialog: shown once, shared by every request waiting on it.
export function askToken(status) {
  if (pendingAsk) return pendingAsk;
  pendingAsk = new Promise((resolve) => {
    const dialog = el("dialog", { id: "token-dialog" },
      el("form", { method: "dialog" },
        el("h2", {}, "API token"),
        el("p", {}, status === 403
          ? "The stored token is unknown or revoked. Paste a valid one."
          : "This service needs a token to read jobs. Create one with `tuner token create --name NAME`."),
        el("input", { id: "token-input", name: "token", type: "password", autocomplete: "off", required: "" }),
        el("menu", {},
          el("button", { id: "token-save", value: "save" }, "Save"),
          el("button", { id: "token-cancel", value: "cancel", formnovalidate: "" }, "Cancel"))));
    document.body.append(dialog);
    dialog.addEventListener("close", () => {
      const value = dialog.querySelector("#token-input").value.trim();
      const save = dialog.returnValue === "save" && value;
      if (save) localStorage.setItem(TOKEN_KEY, value);
      dialog.remove();
      pendingAsk = null;
      resolve(Boolean(save));
    });
    dialog.showModal();
  });
  return pendingAsk;
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function num(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function bytes(x) {
  if (x === null || x === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(x), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function pct(x, digits = 1) {
  return x === null || x === undefined ? "–" : `${(x * 100).toFixed(digits)}%`;
}

export function seconds(x) {
  if (x === null || x === undefined) return "–";
  if (x < 1) return `${(x * 1000).toFixed(0)} ms`;
  if (x < 120) return `${x.toFixed(1)} s`;
  return `${(x / 60).toFixed(1)} min`;
}

export function age(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

export function label(value) {
  if (value === null || value === undefined) return "–";
  return String(value);
}

export function badge(state) {
  return el("span", { class: `badge state-${state}` }, state);
}

export function showError(where, err) {
  where.replaceChildren(el("p", { class: "error" }, err.message || String(err)));
}
