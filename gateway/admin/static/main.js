// The console's start: sign-in, the refresh loop (every REFRESH_MS, the whole page redrawn from one answer
// without flicker), the countdown ticker, and the small history the sparklines draw.

import { actionsFor, setUpExplain } from "./actions.js";
import { api, ApiError, actor, signIn, signOut, token } from "./api.js";
import { renderAudit, renderClasses, renderHeader, renderOverrides, renderPools, renderTenants } from "./panels.js";
import { clock, duration, text } from "./view.js";

const REFRESH_MS = 2000;
const HISTORY = 150; // points per sparkline: five minutes at one refresh every two seconds
const AUDIT_LIMIT = 200;

const $ = (id) => document.getElementById(id);

function makeHistory() {
  const pools = new Map();
  const classes = new Map();
  const push = (arr, v) => {
    arr.push(v === undefined ? null : v);
    if (arr.length > HISTORY) arr.shift();
  };
  return {
    record(state) {
      for (const [name, p] of Object.entries(state.pools)) {
        if (!pools.has(name)) pools.set(name, { waiting: [], inFlight: [] });
        push(pools.get(name).waiting, p.waiting);
        push(pools.get(name).inFlight, p.cluster_in_flight ?? p.in_flight);
      }
      for (const c of state.classes) {
        if (!c.controller) continue;
        if (!classes.has(c.name)) classes.set(c.name, []);
        push(classes.get(c.name), c.controller.share);
      }
    },
    pool: (name) => pools.get(name) || { waiting: [], inFlight: [] },
    klass: (name) => classes.get(name) || [],
  };
}

const page = {
  state: null,
  audit: null,
  skew: 0, // the gateway's clock minus this browser's, in seconds
  timer: null,
  lastOk: null,
  history: makeHistory(),
};

function banner(message, kind) {
  const el = $("banner");
  if (!message) {
    el.hidden = true;
    el.textContent = "";
    return;
  }
  el.className = `banner ${kind}`;
  el.setAttribute("role", kind === "error" ? "alert" : "status");
  el.textContent = message;
  el.hidden = false;
}

const ctx = {
  canChange: false,
  history: page.history,
  serverNow: () => Date.now() / 1000 + page.skew,
  defaults: () => page.state.admin,
  config: () => page.state.config,
  notice: (message) => banner(message, "notice"),
  refresh: () => refresh(),
};
ctx.act = actionsFor(ctx);
const prefillExplain = setUpExplain(ctx);

function showLogin(message) {
  stop();
  $("main").hidden = true;
  $("reload-btn").hidden = true;
  $("logout-btn").hidden = true;
  $("login").hidden = false;
  $("mode").textContent = "signed out";
  $("mode").className = "chip bad";
  $("login-error").textContent = message || "";
  $("login-actor").value = actor();
  $("login-token").value = "";
  $("login-token").focus();
}

function render() {
  const s = page.state;
  ctx.canChange = s.admin.changes_allowed;
  $("login").hidden = true;
  $("main").hidden = false;
  $("reload-btn").hidden = !ctx.canChange;
  $("logout-btn").hidden = !s.admin.changes_allowed;
  const mode = $("mode");
  if (ctx.canChange) {
    mode.textContent = actor() ? `signed in as ${actor()}` : "signed in";
    mode.className = "chip ok";
  } else if (s.admin.changes_refused) {
    mode.textContent = "read-only: per-worker state";
    mode.className = "chip warn";
    mode.title = s.admin.changes_refused;
  } else {
    mode.textContent = "read-only: no admin token on this gateway";
    mode.className = "chip warn";
    mode.title = "The gateway runs without SPECGATE_ADMIN_TOKEN, so its admin API refuses every change.";
  }
  renderHeader(s, ctx);
  renderPools(s, ctx);
  renderClasses(s, ctx);
  renderTenants(s);
  renderOverrides(s, ctx);
  if (page.audit) renderAudit(page.audit);
  const firstPool = Object.values(s.pools)[0];
  prefillExplain(firstPool && firstPool.models.length ? firstPool.models[0] : "");
}

function stop() {
  if (page.timer !== null) clearTimeout(page.timer);
  page.timer = null;
}

async function refresh() {
  stop();
  try {
    const [state, audit] = await Promise.all([api.state(), api.audit(AUDIT_LIMIT)]);
    page.skew = state.now - Date.now() / 1000;
    page.state = state;
    page.audit = audit;
    page.lastOk = Date.now();
    page.history.record(state);
    render();
    if ($("banner").classList.contains("error")) banner(null);
    text("refreshed", `updated ${new Date().toLocaleTimeString(undefined, { hour12: false })}`);
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    if (err.status === 401) {
      const had = token();
      signOut();
      showLogin(had ? `The gateway refused this token: ${err.message}` : "");
      return;
    }
    const since = page.lastOk ? ` Showing the data of ${clock(page.lastOk / 1000)}.` : "";
    banner(`${err.status ? `${err.status}: ` : ""}${err.message}.${since}`, "error");
  }
  stop(); // a refresh asked for meanwhile (after a change) may have set one already
  page.timer = setTimeout(refresh, REFRESH_MS);
}

function tick() {
  const now = ctx.serverNow();
  for (const el of document.querySelectorAll(".countdown[data-expires]")) {
    const left = Number(el.getAttribute("data-expires")) - now;
    el.textContent = left > 0 ? `${duration(left)} left` : "expiring…";
  }
}

$("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const t = $("login-token").value.trim();
  if (!t) {
    $("login-error").textContent = "Type the admin token.";
    return;
  }
  signIn(t, $("login-actor").value.trim());
  $("login-error").textContent = "checking…";
  refresh();
});
$("logout-btn").addEventListener("click", () => {
  signOut();
  banner(null);
  showLogin("Signed out: the token is forgotten in this tab.");
});
$("reload-btn").addEventListener("click", () => ctx.act.reload());
for (const id of ["audit-actor", "audit-action", "audit-target"]) {
  $(id).addEventListener("input", () => page.audit && renderAudit(page.audit));
}
$("config-yaml").addEventListener("toggle", async () => {
  if (!$("config-yaml").open) return;
  try {
    $("config-text").textContent = (await api.config()).yaml;
  } catch (err) {
    $("config-text").textContent = err.message;
  }
});
setInterval(tick, 1000);
refresh();
