// Submit (#/submit): paste a YAML or JSON spec. YAML is parsed here (the API takes JSON);
// everything else is the API's call, and its 422 messages are shown exactly as worded.

import { api } from "./api.js";
import { load as loadYaml } from "../vendor/js-yaml/js-yaml.min.js";
import { h } from "./util.js";

const DRAFT_KEY = "elastrain.draft";

export const EXAMPLE = `# A job spec, YAML or JSON. Everything but name and workload has a default.
name: gpt-tiny
workload:
  name: gpt                 # built-in: gpt | synthetic  (or entrypoint: "pkg.module:factory")
  params: {n_layer: 4, n_embd: 128, n_head: 4, seq_len: 128}
strategy:
  kind: ddp                 # ddp | fsdp | pipeline
scaling:
  min_workers: 1
  max_workers: 2
  use_gpu: false
  cpus_per_worker: 1
training:
  global_batch_size: 32     # fixed whatever the world size
  micro_batch_size: 8
  learning_rate: 0.0003
  max_steps: 200
checkpoint:
  every_steps: 20
  keep_last: 3
priority: 0
labels: {team: nlp}
`;

export function mount(main) {
  const text = h("textarea", {
    id: "spec-input", name: "spec", rows: 26, spellcheck: "false", autocomplete: "off",
    "aria-describedby": "spec-help submit-errors", class: "mono",
  });
  text.value = sessionStorage.getItem(DRAFT_KEY) || EXAMPLE;
  const errors = h("div", { id: "submit-errors", class: "errors", role: "alert", "aria-live": "assertive" });
  const submitBtn = h("button", { class: "btn btn-primary", type: "submit", id: "submit-btn" }, "Submit job");
  const exampleBtn = h("button", { class: "btn", type: "button" }, "Load example");
  const status = h("span", { class: "muted", "aria-live": "polite" });

  const form = h("form", { class: "submit-form", id: "submit-form", novalidate: true },
    h("label", { for: "spec-input", class: "block-label" }, "Job spec"),
    h("p", { id: "spec-help", class: "muted small" },
      "YAML or JSON. The service checks every field; its messages appear below exactly as it words them."),
    text,
    errors,
    h("div", { class: "actions" }, submitBtn, exampleBtn, status));

  main.append(h("div", { class: "page-head" }, h("h1", {}, "Submit a job")), form);

  text.addEventListener("input", () => sessionStorage.setItem(DRAFT_KEY, text.value));
  exampleBtn.addEventListener("click", () => {
    text.value = EXAMPLE;
    sessionStorage.removeItem(DRAFT_KEY);
    errors.replaceChildren();
    text.focus();
  });

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    errors.replaceChildren();
    let spec;
    try {
      spec = parseSpec(text.value);
    } catch (err) {
      showErrors(errors, text, [{ loc: ["spec"], msg: err.message, local: true }],
        "The spec could not be parsed:");
      return;
    }
    submitBtn.disabled = true;
    status.textContent = "Submitting…";
    try {
      const job = await api.submit(spec);
      sessionStorage.removeItem(DRAFT_KEY);
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      if (err.status === 422 && err.detail.length) {
        showErrors(errors, text, err.detail, "The service rejected this spec:");
      } else {
        showErrors(errors, text, [{ loc: [], msg: err.message }], `Submit failed (HTTP ${err.status || "—"}):`);
      }
    } finally {
      submitBtn.disabled = false;
      status.textContent = "";
    }
  });
}

/** JSON when it looks like JSON (better messages), else YAML. Empty input is an error. */
export function parseSpec(source) {
  const trimmed = source.trim();
  if (!trimmed) throw new Error("The spec is empty.");
  if (trimmed.startsWith("{") || trimmed.startsWith("[")) {
    try { return JSON.parse(trimmed); } catch (e) { throw new Error(`JSON: ${e.message}`); }
  }
  try {
    return loadYaml(source);
  } catch (e) {
    throw new Error(`YAML: ${e.message}`);
  }
}

function showErrors(box, text, detail, heading) {
  box.replaceChildren(
    h("p", { class: "error-head" }, heading),
    h("ul", {}, ...detail.map((d) => {
      const loc = Array.isArray(d.loc) ? d.loc : [];
      const where = loc.length ? loc.join(".") : "";
      const line = d.local ? null : locate(text.value, loc.slice(1).map(String));
      const item = h("li", { class: "error-item" },
        where ? h("code", { class: "loc" }, where) : "",
        h("span", { class: "msg" }, d.msg));
      if (line !== null) {
        item.append(h("button", {
          class: "btn btn-link btn-sm", type: "button",
          onclick: () => selectLine(text, line),
          "aria-label": `Go to line ${line + 1} of the spec`,
        }, `line ${line + 1}`));
      }
      return item;
    })));
}

/** The line of the deepest key of `path` (e.g. ["scaling","min_workers"]) in YAML/JSON text. */
function locate(source, path) {
  const lines = source.split("\n");
  let from = 0;
  let indent = -1;
  let found = null;
  for (const key of path) {
    if (/^\d+$/.test(key)) continue;
    const esc = key.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
    const re = new RegExp(`^(\\s*)(?:-\\s+)?["']?${esc}["']?\\s*:`);
    let hit = null;
    for (let i = from; i < lines.length; i++) {
      const m = lines[i].match(re);
      if (m && m[1].length > indent) { hit = i; indent = m[1].length; break; }
      // Also flow mappings on one line: "scaling: {min_workers: 3}".
      if (found !== null && new RegExp(`[{,]\\s*["']?${esc}["']?\\s*:`).test(lines[i]) && i === found) { hit = i; break; }
    }
    if (hit === null) break;
    found = hit;
    from = hit;
  }
  return found;
}

function selectLine(text, line) {
  const lines = text.value.split("\n");
  const start = lines.slice(0, line).reduce((n, l) => n + l.length + 1, 0);
  text.focus();
  text.setSelectionRange(start, start + lines[line].length);
  const lineHeight = text.scrollHeight / Math.max(1, lines.length);
  text.scrollTop = Math.max(0, lineHeight * (line - 3));
}
