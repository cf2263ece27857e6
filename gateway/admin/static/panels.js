// The read side of the console: the header, pools and endpoints, classes, overrides, audit log and config, drawn
// from /admin/state and /admin/audit. `ctx` carries what a panel needs besides the data: whether changes are
// allowed, the server clock, the history for sparklines, and `act` (the action dialogs of actions.js).

import { badge, clock, duration, h, labelled, num, pct, sparkline, swap, text, when } from "./view.js";

// Seconds left of an override, by the gateway's clock; a span that main.js's ticker keeps counting down.
function countdown(expiresAt, ctx) {
  if (expiresAt === null || expiresAt === undefined) return h("span", { class: "left" }, "until removed");
  const left = expiresAt - ctx.serverNow();
  return h("span", { class: "left countdown", "data-expires": expiresAt }, `${duration(left)} left`);
}

export function describeOverride(o) {
  switch (o.kind) {
    case "drain":
      return `drain pool ${o.pool}`;
    case "pool_weight":
      return `pool ${o.pool} weight ${o.value}`;
    case "endpoint_weight":
      return `endpoint ${o.pool}/${o.endpoint} weight ${o.value}`;
    case "class_route":
      return `class ${o.class} forced to ${o.value}`;
    default:
      return o.kind;
  }
}

function button(label, key, onclick, opts) {
  // opts.title: the accessible name when the visible label alone is ambiguous (also the tooltip)
  const o = opts || {};
  return h("button", { type: "button", "data-key": key, onclick, class: o.cls || "", title: o.title, "aria-label": o.title }, label);
}

export function renderHeader(state, ctx) {
  const c = state.config;
  text("config-summary", `config v${c.version} · ${String(c.hash).slice(0, 12)} · loaded ${clock(c.loaded_at)}`);
  const s = state.store || {};
  const idem = s.idempotency || {};
  const ovr = s.overrides || {};
  const storeOk = idem.healthy !== false && !ovr.last_error;
  const el = document.getElementById("store-summary");
  swap(
    el,
    h("span", { class: `dot ${storeOk ? "ok" : "bad"}`, "aria-hidden": "true" }),
    `store ${idem.name || ovr.store || "?"}: ${storeOk ? "healthy" : "trouble"}`,
    ovr.last_error ? ` (overrides: ${ovr.last_error})` : "",
    idem.healthy === false && idem.last_error ? ` (${idem.last_error})` : "",
  );
  const cl = state.cluster;
  const clusterEl = document.getElementById("cluster-summary");
  if (cl && cl.enabled) {
    // leader: scrapes and publishes; follower: routes on the leader's snapshot; local: on its own numbers
    const age = cl.snapshot_age_s === null || cl.snapshot_age_s === undefined ? "" : ` · snapshot ${num(cl.snapshot_age_s, 1)}s old`;
    const what =
      cl.role === "leader"
        ? `${cl.replica} leads`
        : cl.role === "follower"
          ? `${cl.replica} follows ${cl.leader || "?"}`
          : `${cl.replica} routes on its own numbers (no fresh snapshot)`;
    swap(clusterEl, h("span", { class: `dot ${cl.role === "local" ? "bad" : "ok"}`, "aria-hidden": "true" }), `cluster: ${what}${age}`);
  } else {
    swap(clusterEl);
  }
  const cfg = document.getElementById("config");
  const row = (k, v) => [h("dt", {}, k), h("dd", {}, v)];
  swap(
    cfg,
    row("source", c.source),
    row("version", String(c.version)),
    row("hash", c.hash),
    row("loaded at", clock(c.loaded_at)),
    row("embeddings pool", state.embeddings_pool || "none"),
    row("TTL of a change", `${duration(state.admin.default_ttl_s)} by default, at most ${duration(state.admin.max_ttl_s)}`),
    row("gateway up since", clock(state.started_at)),
  );
}

function poolCard(name, p, ctx) {
  const drained = p.overrides.some((o) => o.kind === "drain");
  const hist = ctx.history.pool(name);
  const metrics = h(
    "dl",
    { class: "metrics" },
    [
      ["in flight", num(p.cluster_in_flight ?? p.in_flight)], // every replica's and worker's, not one worker's
      ["queue", num(p.waiting)],
      ["batch", num(p.running)],
      ["KV", pct(p.kv_usage)],
      ["acceptance", pct(p.acceptance_rate)],
      ["routable", `${p.routable_endpoints}/${p.endpoints.length}`],
    ].map(([k, v]) => h("div", {}, h("dt", {}, k), h("dd", {}, v))),
  );
  const charts = h(
    "div",
    { class: "charts" },
    h("div", {}, h("span", { class: "label" }, "queue"), sparkline(hist.waiting, `pool ${name} queue`)),
    h("div", {}, h("span", { class: "label" }, "in flight"), sparkline(hist.inFlight, `pool ${name} in flight`)),
  );
  const overrides = p.overrides.length
    ? h(
        "ul",
        { class: "pool-overrides" },
        p.overrides.map((o) =>
          h("li", {}, badge(describeOverride(o), o.kind === "drain" ? "warn" : "info"), " ", countdown(o.expires_at, ctx), o.reason ? h("span", { class: "reason" }, ` ${o.reason} (${o.actor})`) : null),
        ),
      )
    : null;
  const actions = ctx.canChange
    ? h(
        "div",
        { class: "actions" },
        drained
          ? button("Undrain", `undrain:${name}`, () => ctx.act.undrain(name), { cls: "primary" })
          : button("Drain", `drain:${name}`, () => ctx.act.drain(name), { cls: "danger" }),
        button("Set weight", `pw:${name}`, () => ctx.act.poolWeight(name, p), { title: `Set the weight of every endpoint of pool ${name}` }),
      )
    : null;
  const rows = p.endpoints.map((e) => {
    const changed = e.effective_weight !== e.configured_weight;
    return h(
      "tr",
      {},
      h("th", { scope: "row" }, e.id, h("div", { class: "url" }, e.url)),
      h(
        "td",
        {},
        e.healthy ? badge("healthy", "ok") : badge("unhealthy", "bad"),
        e.ejected ? [" ", badge(`ejected ${duration(e.ejected_for_s)}`, "bad")] : null,
        !e.routable && e.healthy && !e.ejected ? [" ", badge("no new requests", "warn")] : null,
        e.last_error ? h("div", { class: "err" }, e.last_error) : null,
      ),
      h(
        "td",
        { class: `num ${changed ? "changed" : ""}` },
        num(e.effective_weight, 2),
        changed ? h("div", { class: "desc" }, `YAML ${num(e.configured_weight, 2)}`) : null,
      ),
      h("td", { class: "num" }, num(e.in_flight + (e.remote_in_flight || 0))),
      // the server's measured prefix-cache hit rate over the scrape window; "–" while unknown
      h("td", { class: "num", "data-col": "prefix hits", title: `${num(e.prefix_index_chunks)} prompt chunks in the gateway's index` }, pct(e.prefix_hit_ratio)),
      ctx.canChange ? h("td", {}, button("Weight", `ew:${name}/${e.id}`, () => ctx.act.endpointWeight(name, e), { title: `Set the weight of endpoint ${e.id}` })) : null,
    );
  });
  const table = h(
    "div",
    { class: "scroll" },
    labelled(
      h(
        "table",
        { class: "grid stack endpoints" },
        h("caption", { class: "sr-only" }, `Endpoints of pool ${name}`),
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["endpoint", "health", "weight", "in flight", "prefix hits"].map((t) => h("th", { scope: "col", class: t === "endpoint" || t === "health" ? "" : "num" }, t)),
            ctx.canChange ? h("th", { scope: "col" }, h("span", { class: "sr-only" }, "actions")) : null,
          ),
        ),
        h("tbody", {}, rows),
      ),
    ),
  );
  const stale = p.scraped ? (p.stale ? badge("load data stale", "warn") : null) : badge("not scraped yet", "warn");
  return h(
    "article",
    { class: `card pool ${drained ? "drained" : ""}`, "data-pool": name, "aria-label": `pool ${name}` },
    h("header", {}, h("h3", {}, name), badge(p.kind, p.kind === "speculative" ? "spec" : "std"), drained ? badge("drained", "warn") : null, stale, h("span", { class: "models" }, p.models.join(", "))),
    metrics,
    charts,
    overrides,
    actions,
    table,
  );
}

export function renderPools(state, ctx) {
  swap(
    document.getElementById("pools"),
    Object.entries(state.pools).map(([name, p]) => poolCard(name, p, ctx)),
  );
}

function classRow(c, ctx) {
  const ctl = c.controller;
  const route = c.route;
  const routeText = `${route.preferred}${route.saturated ? ` (saturated: ${route.saturated})` : ""}${route.fallback.length ? ` → ${route.fallback.join(", ")}` : ""}`;
  const force = c.overrides.find((o) => o.kind === "class_route");
  const state = ctl ? ctl.state : "static";
  const guard = ctl ? [ctl.locked ? badge("locked off", "bad") : null, ctl.guard_tripped ? badge(`guard: ${ctl.guard_cause || "tripped"}`, "bad") : null] : null;
  const actions = ctx.canChange
    ? h(
        "td",
        { class: "actions" },
        button("Speculative", `cr:${c.name}:speculative`, () => ctx.act.force(c.name, "speculative"), { title: `Force class ${c.name} to its speculative pool` }),
        button("Standard", `cr:${c.name}:standard`, () => ctx.act.force(c.name, "standard"), { title: `Force class ${c.name} to its standard pool` }),
        force ? button("Auto", `cr:${c.name}:auto`, () => ctx.act.force(c.name, "auto"), { cls: "primary", title: `Give class ${c.name} back to its route` }) : null,
      )
    : null;
  return h(
    "tr",
    { "data-class": c.name },
    h("th", { scope: "row" }, c.name, c.description ? h("div", { class: "desc" }, c.description) : null),
    h("td", {}, routeText),
    h("td", {}, badge(state, state === "speculative" ? "spec" : state === "standard" ? "std" : "info"), " ", guard),
    h("td", { class: "share" }, ctl ? pct(ctl.share) : "–", ctl ? sparkline(ctx.history.klass(c.name), `class ${c.name} speculative share`, 1) : null),
    h(
      "td",
      {},
      ctl ? ctl.last_reason || "–" : "–",
      // a force removed: the controller keeps the forced state until its next round decides
      ctl && !force && ctl.last_reason === "manual" ? h("div", { class: "desc" }, "force removed: the controller decides at its next round") : null,
      ctl && ctl.holding ? h("div", { class: "desc" }, `holding: ${ctl.holding}`) : null,
    ),
    h("td", {}, force ? [badge(`forced ${force.value}`, "warn"), " ", countdown(force.expires_at, ctx)] : "–"),
    actions,
  );
}

export function renderClasses(state, ctx) {
  const head = h(
    "thead",
    {},
    h(
      "tr",
      {},
      ["class", "route", "state", "share on speculative", "last reason", "on-call force"].map((t) => h("th", { scope: "col" }, t)),
      ctx.canChange ? h("th", { scope: "col" }, "force route") : null,
    ),
  );
  const table = document.getElementById("classes");
  swap(table, head, h("tbody", {}, state.classes.map((c) => classRow(c, ctx))));
  labelled(table);
}

// Tenants (a tenants file only): in flight against the fair share of each pool they use, shed and limited in the
// last minutes (the totals since start in the cell's title).
function recentCell(t, kind) {
  const recent = t.recent ? t.recent[kind] : t[kind];
  const title = `${t[kind]} since start (this process)`;
  return h("td", { title }, recent ? badge(String(recent), "warn") : "0");
}

function tenantRow(t) {
  const lim = t.limits || {};
  const limits = [
    lim.requests_per_minute ? `${lim.requests_per_minute} req/min` : null,
    lim.tokens_per_minute ? `${lim.tokens_per_minute} tok/min` : null,
    lim.max_concurrent ? `${lim.max_concurrent} at once` : null,
  ].filter((x) => x);
  const pools = Object.entries(t.pools || {}).map(([pool, p]) => {
    const over = p.share !== null && p.in_flight > p.share;
    const share = p.share === null ? "–" : num(p.share, 1);
    const queued = (t.waiting || {})[pool];
    return h("div", {}, `${pool}: ${p.in_flight} of share ${share} (bound ${p.bound === null ? "–" : p.bound}) `, over ? badge("above share", "warn") : null, queued ? badge(`${queued} waiting`, "warn") : null);
  });
  return h(
    "tr",
    { "data-tenant": t.name },
    h("th", { scope: "row" }, t.name),
    h("td", {}, String(t.priority)),
    h("td", {}, num(t.weight, 2)),
    h("td", {}, String(t.in_flight)),
    h("td", {}, pools.length ? pools : "–"),
    recentCell(t, "shed"),
    recentCell(t, "limited"),
    h("td", {}, limits.length ? limits.join(", ") : "none"),
  );
}

export function renderTenants(state) {
  const section = document.getElementById("tenants-section");
  if (!section) return;
  section.hidden = !state.tenants;
  if (!state.tenants) return;
  const first = state.tenants.find((t) => t.recent);
  const minutes = first ? `${num(first.recent.window_s / 60, 0)} min` : "since start";
  const cols = ["tenant", "priority", "weight", "in flight", "pools (in flight vs share)", `shed (${minutes})`, `limited (${minutes})`, "limits"];
  const head = h("thead", {}, h("tr", {}, cols.map((t) => h("th", { scope: "col" }, t))));
  const table = document.getElementById("tenants");
  swap(table, head, h("tbody", {}, state.tenants.map(tenantRow)));
  labelled(table);
}

export function renderOverrides(state, ctx) {
  const table = document.getElementById("overrides");
  if (!state.overrides.length) {
    swap(table, h("tbody", {}, h("tr", {}, h("td", { class: "empty" }, "No overrides: everything routes as the YAML and the controllers say."))));
    return;
  }
  const head = h(
    "thead",
    {},
    h("tr", {}, ["change", "time left", "reason", "by", "id"].map((t) => h("th", { scope: "col" }, t)), ctx.canChange ? h("th", { scope: "col" }, h("span", { class: "sr-only" }, "actions")) : null),
  );
  const rows = state.overrides.map((o) =>
    h(
      "tr",
      { "data-override": o.id },
      h("td", { class: "what" }, describeOverride(o)),
      h("td", {}, countdown(o.expires_at, ctx)),
      h("td", {}, o.reason),
      h("td", {}, o.actor),
      h("td", { class: "mono" }, o.id),
      ctx.canChange ? h("td", {}, button("Remove", `rm:${o.id}`, () => ctx.act.remove(o), { cls: "danger", title: `Remove override ${o.id}: ${describeOverride(o)}` })) : null,
    ),
  );
  swap(table, head, h("tbody", {}, rows));
  labelled(table);
}

function matches(value, filter) {
  return !filter || String(value).toLowerCase().includes(filter);
}

export function renderAudit(audit) {
  const f = (id) => document.getElementById(id).value.trim().toLowerCase();
  const [actor, action, target] = [f("audit-actor"), f("audit-action"), f("audit-target")];
  const records = audit.records.filter((r) => matches(r.actor, actor) && matches(r.action, action) && matches(r.target, target)).reverse();
  const head = h("thead", {}, h("tr", {}, ["when", "actor", "action", "target", "reason"].map((t) => h("th", { scope: "col" }, t))));
  const body = records.length
    ? records.map((r) =>
        h(
          "tr",
          {},
          h("td", { class: "when", title: clock(r.at) }, when(r.at)),
          h("td", {}, r.actor),
          h("td", {}, r.action),
          h("td", { class: "mono" }, r.target),
          h("td", {}, r.reason),
        ),
      )
    : h("tr", {}, h("td", { colspan: 5, class: "empty" }, audit.records.length ? "No record matches the filter." : "No changes recorded yet."));
  const caption = h("caption", {}, `${records.length} of the latest ${audit.records.length} records (${audit.total} ever), newest first`);
  const table = document.getElementById("audit");
  swap(table, caption, head, h("tbody", {}, body));
  labelled(table);
}
