// The REST client. Every call goes through `request`, which adds the bearer token, turns
// error bodies into ApiError (keeping the API's own wording), and on a 401 asks for a token
// once (one dialog however many requests were refused at the same time).

const TOKEN_KEY = "elastrain.token";
const listeners = new Set();

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
    // FastAPI/pydantic: [{loc, msg, type}] for 422; a string for HTTPException.
    this.detail = body && Array.isArray(body.detail) ? body.detail : [];
  }
}

export function getToken() {
  try { return sessionStorage.getItem(TOKEN_KEY); } catch { return null; }
}

export function setToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
  for (const fn of listeners) fn(!!token);
}

export function onTokenChange(fn) { listeners.add(fn); }

/** Connection status for the top bar: "ok" | "error" | "auth". */
export const connection = { state: "unknown", since: Date.now(), onChange: null };
function setConnection(state) {
  if (connection.state !== state) {
    connection.state = state;
    connection.since = Date.now();
    if (connection.onChange) connection.onChange(state);
  }
}

let pendingToken = null; // Promise<string|null> while the dialog is open

function askToken(rejected) {
  if (pendingToken) return pendingToken;
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  const err = document.getElementById("token-error");
  err.hidden = !rejected;
  err.textContent = rejected ? "The service rejected that token. Try again." : "";
  input.value = "";
  pendingToken = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      pendingToken = null;
      const token = dialog.returnValue === "ok" ? input.value.trim() : "";
      if (token) setToken(token);
      resolve(token || null);
    }, { once: true });
  });
  dialog.showModal();
  input.focus();
  return pendingToken;
}

function messageOf(status, body, fallback) {
  if (body && typeof body === "object") {
    if (typeof body.message === "string" && body.message) return body.message;
    if (typeof body.detail === "string") return body.detail;
    if (Array.isArray(body.detail) && body.detail.length) {
      return body.detail.map((d) => d.msg).join("; ");
    }
  }
  if (typeof body === "string" && body) return body;
  return fallback || `HTTP ${status}`;
}

/** fetch JSON; throws ApiError (status 0 when the service is unreachable). */
export async function request(path, { method = "GET", body, signal, retryAuth = true } = {}) {
  const headers = { Accept: "application/json" };
  const token = getToken();
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(path, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    setConnection("error");
    throw new ApiError(0, "The elastrain API is unreachable.", null);
  }
  const text = await res.text();
  let data = null;
  if (text) {
    try { data = JSON.parse(text); } catch { data = text; }
  }
  if (res.status === 401 && retryAuth) {
    setConnection("auth");
    const hadToken = !!token;
    if (hadToken && getToken() === token) setToken(null);
    const fresh = getToken() || (await askToken(hadToken));
    if (fresh) return request(path, { method, body, signal, retryAuth: true });
    throw new ApiError(401, messageOf(401, data, "A token is required."), data);
  }
  if (!res.ok) {
    if (res.status >= 500) setConnection("error"); else setConnection("ok");
    throw new ApiError(res.status, messageOf(res.status, data, res.statusText), data);
  }
  setConnection("ok");
  return data;
}

const enc = encodeURIComponent;

export const api = {
  listJobs({ state = "", label = "", limit = 50, offset = 0 } = {}, opts) {
    const q = new URLSearchParams();
    for (const s of String(state).split(",").filter(Boolean)) q.append("state", s);
    // "team:nlp, size:tiny" -> label=team:nlp&label=size:tiny (jobs must match all).
    for (const l of String(label).split(",").map((x) => x.trim()).filter(Boolean)) q.append("label", l);
    q.set("limit", String(limit));
    q.set("offset", String(offset));
    return request(`/v1/jobs?${q}`, opts);
  },
  job: (id, opts) => request(`/v1/jobs/${enc(id)}`, opts),
  submit: (spec) => request("/v1/jobs", { method: "POST", body: spec }),
  cancel: (id) => request(`/v1/jobs/${enc(id)}/cancel`, { method: "POST" }),
  checkpoint: (id) => request(`/v1/jobs/${enc(id)}/checkpoint`, { method: "POST" }),
  events: (id) => request(`/v1/jobs/${enc(id)}/events`),
  metrics: (id, sinceStep = 0, maxPoints = 2000) =>
    request(`/v1/jobs/${enc(id)}/metrics?since_step=${sinceStep}&max_points=${maxPoints}`),
  checkpoints: (id) => request(`/v1/jobs/${enc(id)}/checkpoints`),
  logs: (id, offset = "0", attempt = null) => request(
    `/v1/jobs/${enc(id)}/logs?offset=${enc(offset)}${attempt === null ? "" : `&attempt=${attempt}`}`),
  cluster: () => request("/v1/cluster"),
  me: () => request("/v1/me"),
};
