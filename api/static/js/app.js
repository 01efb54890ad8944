// The app shell: a hash router (#/, #/jobs/ID, #/submit, #/cluster), the top bar's
// connection indicator, who the token acts for, theme toggle and token button. Each view is a module exporting
// `mount(main, params) -> unmount()`; unmount stops its polling.

import { api, connection, getToken, onTokenChange, setToken } from "./api.js";
import * as list from "./list.js";
import * as job from "./job.js";
import * as submit from "./submit.js";
import * as cluster from "./cluster.js";
import { debug, fmtDuration, h } from "./util.js";

const routes = [
  { re: /^\/?$/, view: list, nav: "list", title: "Jobs" },
  { re: /^\/jobs\/(\d+)$/, view: job, nav: "list", title: "Job" },
  { re: /^\/submit$/, view: submit, nav: "submit", title: "Submit" },
  { re: /^\/cluster$/, view: cluster, nav: "cluster", title: "Cluster" },
];

const main = document.getElementById("main");
let unmount = null;

function route() {
  const raw = location.hash.replace(/^#/, "");
  const [path, query = ""] = raw.split("?");
  const found = routes.find((r) => r.re.test(path || "/"));
  if (unmount) { unmount(); unmount = null; }
  main.replaceChildren();
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (found && a.dataset.nav === found.nav) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (!found) {
    main.append(Object.assign(document.createElement("h1"), { textContent: "Not found" }));
    document.title = "Not found · elastrain";
    return;
  }
  document.title = `${found.title} · elastrain`;
  const params = { match: path.match(found.re), query: new URLSearchParams(query) };
  unmount = found.view.mount(main, params) || null;
  debug.route = path || "/";
}

function initTopbar() {
  const conn = document.getElementById("conn");
  const text = conn.querySelector(".conn-text");
  const show = () => {
    const s = connection.state;
    conn.dataset.state = s;
    text.textContent = s === "ok" ? "live" : s === "auth" ? "token needed"
      : s === "error" ? `API unreachable ${fmtDuration((Date.now() - connection.since) / 1000)}` : "connecting…";
  };
  const whoami = initWhoami();
  connection.onChange = () => { show(); whoami.sync(); };
  setInterval(() => { if (connection.state === "error") show(); }, 1000);
  show();

  const signout = document.getElementById("signout");
  const syncToken = () => { signout.hidden = !getToken(); };
  onTokenChange(syncToken);
  syncToken();
  signout.addEventListener("click", () => { setToken(null); location.reload(); });

  document.getElementById("theme").addEventListener("click", () => {
    const root = document.documentElement;
    const dark = root.dataset.theme
      ? root.dataset.theme === "dark"
      : matchMedia("(prefers-color-scheme: dark)").matches;
    root.dataset.theme = dark ? "light" : "dark";
    try { localStorage.setItem("elastrain.theme", root.dataset.theme); } catch { /* ignore */ }
    window.dispatchEvent(new Event("themechange"));
  });
}

/**
 * The tenant the token acts for (GET /v1/me), next to the connection indicator. Asked once
 * the API has answered a view (so it never opens the token dialog itself) and again for
 * every new token; "no auth" when the service runs without authentication.
 */
function initWhoami() {
  const el = document.getElementById("whoami");
  let shownFor; // the token (null: none) the shown answer is for; undefined: nothing shown
  let asking = false;

  function render(me) {
    if (!me.auth) {
      el.className = "whoami muted";
      el.title = "This service runs without authentication";
      el.replaceChildren("no auth");
    } else {
      el.className = "whoami";
      el.title = `Signed in as tenant ${me.tenant}${me.admin ? " (admin: sees every tenant's jobs)" : ""}`;
      el.replaceChildren(h("span", { class: "whoami-tenant mono" }, me.tenant),
        me.admin ? h("span", { class: "whoami-admin" }, "admin") : "");
    }
    el.hidden = false;
  }

  async function sync() {
    const token = getToken();
    if (connection.state !== "ok" || asking || shownFor === token) return;
    asking = true;
    let me = null;
    try {
      me = await api.me();
    } catch (e) {
      // Asked again on the next change of connection state (a failure changes it).
      console.warn("whoami:", e);
    }
    asking = false;
    // The token changed while asking: that answer is another token's; ask for this one.
    if (getToken() !== token) { sync(); return; }
    if (me) { shownFor = token; render(me); }
  }

  onTokenChange(() => { el.hidden = true; shownFor = undefined; sync(); });
  return { sync };
}

initTopbar();
window.addEventListener("hashchange", route);
route();
