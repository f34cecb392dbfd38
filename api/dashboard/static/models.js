// The submit form's list of what a recipe can name, as GET /v1/models gives it (the listing
// `tuner models` prints): the model families, the hf model types, and the installed plugins with
// each one's option schema. "Start from" puts a small recipe for one of them in the form.
import { api, el, showError } from "./common.js";

// A value as YAML flow style: {key: value, ...}, strings JSON-quoted (valid YAML scalars).
function flow(value) {
  if (Array.isArray(value)) return `[${value.map(flow).join(", ")}]`;
  if (value && typeof value === "object") {
    return `{${Object.entries(value).map(([k, v]) => `${k}: ${flow(v)}`).join(", ")}}`;
  }
  return JSON.stringify(value);
}

// The page's starting recipe with its name and model lines swapped for `example`; its other
// sections (train, hardware, search, measure) stay the form's defaults.
function recipeFrom(text, name, what, example) {
  const rest = text.defaultValue.split("\n").filter((line) => line && !/^(#|name:|model:)/.test(line));
  return [`# ${what}`, `name: ${name}-example`, `model: ${flow(example)}`, ...rest].join("\n") + "\n";
}

function startButton(text, note, name, what, example) {
  return el("button", {
    type: "button", class: "start-from", dataset: { model: name },
    onclick: () => {
      text.value = recipeFrom(text, name, what, example);
      text.removeAttribute("aria-invalid");
      document.getElementById("recipe-errors").replaceChildren();
      note.textContent = `A recipe for ${name} is in the form: edit it, then submit.`;
      text.focus();
    },
  }, `Start from ${name}`);
}

function typeOf(prop) {
  if (prop.type) return prop.type;
  if (prop.enum) return prop.enum.map((v) => JSON.stringify(v)).join(" | ");
  return (prop.anyOf || []).map((p) => p.type || "?").join(" | ") || "any";
}

function allowed(prop) {
  const lo = prop.minimum ?? prop.exclusiveMinimum;
  const hi = prop.maximum ?? prop.exclusiveMaximum;
  if (lo === undefined && hi === undefined) return "";
  return `${lo ?? "…"} to ${hi ?? "…"}`;
}

function familyRow(family, text, note) {
  const types = family.model_types || [];
  return el("tr", { dataset: { family: family.name } },
    el("td", {}, el("code", {}, family.name)),
    el("td", {}, family.description,
      types.length ? el("details", { class: "model-types" },
        el("summary", {}, `${types.length} model_type values`), types.join(", ")) : null),
    el("td", {}, family.fields.flatMap((f, i) => [i ? ", " : null, el("code", {}, `model.${f}`)])),
    el("td", {}, family.example
      ? startButton(text, note, family.name, family.description, family.example)
      : el("span", { class: "muted" }, family.name === "plugin" ? "one per installed plugin, below" : "")));
}

function pluginCard(plugin, text, note) {
  if (plugin.error) {
    return el("div", { class: "card plugin", dataset: { plugin: plugin.name } },
      el("h3", {}, plugin.name), el("p", { class: "error" }, `cannot load: ${plugin.error}`));
  }
  const props = plugin.options.properties || {};
  const required = new Set(plugin.options.required || []);
  return el("div", { class: "card plugin", dataset: { plugin: plugin.name } },
    el("h3", {}, plugin.name, " ",
      el("span", { class: "muted package" }, `package ${plugin.package}${plugin.version ? ` ${plugin.version}` : ""}`)),
    el("p", {}, plugin.description),
    el("table", { class: "grid options" },
      el("tr", {}, ...["Option", "Type", "Default", "Allowed", "Meaning"].map((h) => el("th", {}, h))),
      ...Object.entries(props).map(([key, prop]) => el("tr", { dataset: { option: key } },
        el("td", {}, el("code", {}, `model.options.${key}`)),
        el("td", {}, typeOf(prop)),
        el("td", { class: "num" }, "default" in prop ? JSON.stringify(prop.default) : (required.has(key) ? "required" : "–")),
        el("td", {}, allowed(prop)),
        el("td", {}, prop.description || "")))),
    startButton(text, note, plugin.name, plugin.description || plugin.name, plugin.example));
}

export async function loadModels(text, note) {
  const status = document.getElementById("models-status");
  try {
    const models = await api("/v1/models");
    document.querySelector("#families-table tbody").replaceChildren(
      ...models.families.map((f) => familyRow(f, text, note)));
    document.getElementById("plugins").replaceChildren(...(models.plugins.length
      ? models.plugins.map((p) => pluginCard(p, text, note))
      : [el("p", { class: "muted", id: "no-plugins" },
        "No plugins are installed on this service. An operator installs one on the service and its "
        + "workers: a Python package with an entry point in the group tuner.models (README, \"Tuning your model\").")]));
    status.textContent = "";
    document.getElementById("models").dataset.loaded = "true";
  } catch (err) {
    showError(status, err);
  }
}
