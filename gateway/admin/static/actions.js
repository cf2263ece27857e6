// The write side of the console: one confirmation dialog for every change (what it will do, for how long, and
// why), the reload, and the explain form. A refusal shows the admin API's message exactly as it was sent.

import { api } from "./api.js";
import { describeOverride } from "./panels.js";
import { h, num, pct, swap, ttlMeaning, ttlText } from "./view.js";

const $ = (id) => document.getElementById(id);

function weightValue(raw) {
  const t = raw.trim();
  if (t === "") return null; // the API says a weight is required; never read an empty field as 0
  const n = Number(t);
  return Number.isFinite(n) ? n : t;
}

const REASON_REQUIRED = "A reason is required: say why (a ticket, an incident, a sentence).";

function showError(err) {
  const status = err.status ? `${err.status}${err.code ? ` ${err.code}` : ""}: ` : "";
  const issues = err.issues || [];
  // a refused reload: its errors are listed below, each once; the line above says only how many
  const message = issues.length ? `${issues.length} problem(s) in the file; nothing changed.` : err.message;
  $("confirm-error").textContent = `${status}${message}`;
  swap(
    $("confirm-issues"),
    (err.issues || []).map((i) =>
      h("li", {}, h("code", {}, i.path || "(document)"), i.line ? ` (line ${i.line})` : "", `: ${i.message}`),
    ),
  );
}

// spec: {title, effect(values) -> sentence, weight?: initial, ttl?: bool, reason?: bool, ok: label,
//        run(values) -> Promise, done(result) -> notice text}
function openDialog(ctx, spec) {
  const dialog = $("confirm");
  // The button that opened the dialog may be redrawn while it is open: give focus back to its successor.
  const opener = document.activeElement ? document.activeElement.getAttribute("data-key") : null;
  $("confirm-title").textContent = spec.title;
  $("confirm-weight-row").hidden = spec.weight === undefined;
  $("confirm-ttl-row").hidden = !spec.ttl;
  $("confirm-reason-row").hidden = !spec.reason;
  $("confirm-weight").value = spec.weight === undefined ? "" : String(spec.weight);
  $("confirm-ttl").value = ttlText(ctx.defaults().default_ttl_s);
  $("confirm-reason").value = "";
  $("confirm-error").textContent = "";
  swap($("confirm-issues"));
  $("confirm-ok").textContent = spec.ok || "Confirm";
  $("confirm-ok").disabled = false;
  const values = () => ({
    weight: weightValue($("confirm-weight").value),
    ttl: $("confirm-ttl").value,
    reason: $("confirm-reason").value.trim(),
    ttlText: ttlMeaning($("confirm-ttl").value, ctx.defaults().default_ttl_s) || `for "${$("confirm-ttl").value}"`,
  });
  const update = () => {
    $("confirm-effect").textContent = spec.effect(values());
    // the "reason required" warning goes as soon as there is a reason
    if (values().reason && $("confirm-error").textContent === REASON_REQUIRED) $("confirm-error").textContent = "";
  };
  update();
  const form = $("confirm-form");
  const inputs = ["confirm-weight", "confirm-ttl", "confirm-reason"].map($);
  inputs.forEach((i) => i.addEventListener("input", update));
  const close = () => {
    inputs.forEach((i) => i.removeEventListener("input", update));
    form.removeEventListener("submit", submit);
    $("confirm-cancel").removeEventListener("click", cancel);
    dialog.removeEventListener("close", close);
    if (dialog.open) dialog.close();
    const again = opener ? document.querySelector(`[data-key="${CSS.escape(opener)}"]`) : null;
    if (again) again.focus();
  };
  const cancel = () => close();
  const submit = async (event) => {
    event.preventDefault();
    const v = values();
    if (spec.reason && !v.reason) {
      $("confirm-error").textContent = REASON_REQUIRED;
      $("confirm-reason").focus();
      return;
    }
    $("confirm-ok").disabled = true;
    try {
      const result = await spec.run(v);
      close();
      ctx.notice(spec.done ? spec.done(result, v) : "Done.");
      ctx.refresh();
    } catch (err) {
      showError(err);
      $("confirm-ok").disabled = false;
    }
  };
  form.addEventListener("submit", submit);
  $("confirm-cancel").addEventListener("click", cancel);
  dialog.addEventListener("close", close);
  dialog.showModal();
  const first = spec.weight !== undefined ? "confirm-weight" : spec.reason ? "confirm-reason" : "confirm-ok";
  $(first).focus();
}

function weightEffect(target, v) {
  const w = v.weight;
  if (w === 0) return `${target} gets weight 0: no new requests ${v.ttlText}; requests in flight finish.`;
  return `${target} gets weight ${w === null ? "?" : w} ${v.ttlText}, instead of the YAML's.`;
}

export function actionsFor(ctx) {
  return {
    drain: (pool) =>
      openDialog(ctx, {
        title: `Drain pool ${pool}`,
        effect: (v) => `No new requests to pool ${pool} ${v.ttlText}; requests in flight finish.`,
        ttl: true,
        reason: true,
        ok: "Drain",
        run: (v) => api.drain(pool, v.ttl, v.reason),
        done: (r) => `Pool ${pool} drained (override ${r.override.id}).`,
      }),
    undrain: (pool) =>
      openDialog(ctx, {
        title: `Undrain pool ${pool}`,
        effect: () => `Pool ${pool} takes new requests again: its drain is removed now.`,
        reason: true,
        ok: "Undrain",
        run: (v) => api.undrain(pool, v.reason),
        done: (r) => `Pool ${pool} undrained (${r.removed.length} drain removed).`,
      }),
    poolWeight: (pool, p) =>
      openDialog(ctx, {
        title: `Set the weight of pool ${pool}`,
        effect: (v) => weightEffect(`Every endpoint of pool ${pool}`, v),
        weight: p.endpoints.length ? p.endpoints[0].configured_weight : 1,
        ttl: true,
        reason: true,
        ok: "Set weight",
        run: (v) => api.poolWeight(pool, v.weight, v.ttl, v.reason),
        done: (r) => `Pool ${pool}: weight ${r.override.value} (override ${r.override.id}).`,
      }),
    endpointWeight: (pool, e) =>
      openDialog(ctx, {
        title: `Set the weight of endpoint ${e.id}`,
        effect: (v) => weightEffect(`Endpoint ${e.id} of pool ${pool}`, v),
        weight: e.configured_weight,
        ttl: true,
        reason: true,
        ok: "Set weight",
        run: (v) => api.endpointWeight(pool, e.id, v.weight, v.ttl, v.reason),
        done: (r) => `Endpoint ${e.id}: weight ${r.override.value} (override ${r.override.id}).`,
      }),
    force: (klass, route) =>
      openDialog(ctx, {
        title: route === "auto" ? `Give class ${klass} back to its route` : `Force class ${klass} to ${route}`,
        effect: (v) =>
          route === "auto"
            ? `Class ${klass} goes back to its YAML route and controller: the forced route is removed now.`
            : `Requests of class ${klass} go to its ${route} pool first ${v.ttlText}, whatever its controller says.`,
        ttl: route !== "auto",
        reason: true,
        ok: route === "auto" ? "Back to auto" : `Force ${route}`,
        run: (v) => api.classRoute(klass, route, v.ttl, v.reason),
        done: (r) => (route === "auto" ? `Class ${klass} back to auto.` : `Class ${klass} forced to ${route} (override ${r.override.id}).`),
      }),
    remove: (o) =>
      openDialog(ctx, {
        title: `Remove override ${o.id}`,
        effect: () => `The override "${describeOverride(o)}" ends now; routing goes back to what the YAML and the controllers say.`,
        reason: true,
        ok: "Remove",
        run: (v) => api.removeOverride(o.id, v.reason),
        done: () => `Override ${o.id} removed.`,
      }),
    reload: () =>
      openDialog(ctx, {
        title: "Reload the routing YAML",
        effect: () =>
          `Re-read ${ctx.config().source} and switch to it if it is valid. If it is not, nothing changes and every error is listed here with its path.`,
        ok: "Reload",
        run: () => api.reload(),
        done: (r) =>
          r.result === "unchanged"
            ? `Reload: the file is unchanged (hash ${r.hash.slice(0, 12)}).`
            : `Reloaded: version ${r.version}, hash ${r.hash.slice(0, 12)}${r.dropped_overrides.length ? `; ${r.dropped_overrides.length} override(s) dropped (their target is gone)` : ""}.`,
      }),
  };
}

// -- explain ------------------------------------------------------------------------------------------------------

const EXAMPLE = {
  model: "",
  temperature: 0.2,
  messages: [{ role: "user", content: "Write a Python function that reverses a list." }],
};

function table(caption, cols, rows) {
  return h(
    "div",
    { class: "scroll" },
    h(
      "table",
      { class: "grid" },
      h("caption", {}, caption),
      h("thead", {}, h("tr", {}, cols.map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, rows.map((r) => h("tr", {}, r.map((v) => h("td", {}, v === null || v === undefined ? "–" : String(v)))))),
    ),
  );
}

function renderExplain(d) {
  const tc = d.traffic_class;
  const choice = d.choice
    ? `controller: ${d.choice.state}, this request → ${d.choice.pick}${d.choice.forced ? " (forced)" : ""}, share on speculative ${pct(d.choice.share)}`
    : "static route (no controller)";
  const steps = d.plan.steps.map((s) => [s.attempt, s.pool, s.kind, s.reason]);
  const live = Object.entries(d.live).map(([name, p]) => [
    name,
    p.kind,
    p.known ? `${p.routable_endpoints}/${p.endpoints}` : "unknown pool",
    num(p.in_flight),
    num(p.waiting),
    num(p.running),
    pct(p.kv_usage),
    pct(p.acceptance_rate),
    p.saturated === undefined ? "" : p.saturated ? "yes" : "no",
  ]);
  return [
    h(
      "p",
      { class: "verdict" },
      "Class ",
      h("strong", { "data-explain": "class" }, tc.name || "(none)"),
      d.task_type ? ` · task ${d.task_type} (${d.task_source})` : "",
      " · first pool ",
      h("strong", { "data-explain": "first-pool" }, d.plan.steps.length ? d.plan.steps[0].pool : "none: the gateway would answer 503"),
    ),
    h("p", {}, choice, ` · plan: ${d.plan.reason}`),
    table("Attempts, in order (each only if the one before failed before the first byte)", ["#", "pool", "kind", "why"], steps),
    d.plan.skipped.length ? table("Skipped", ["pool", "why"], d.plan.skipped.map((s) => [s.pool, s.reason])) : null,
    table("Live numbers compared", ["pool", "kind", "routable", "in flight", "queue", "batch", "KV", "acceptance", "saturated"], live),
    h("details", {}, h("summary", {}, "The whole answer (JSON)"), h("pre", {}, JSON.stringify(d, null, 2))),
  ];
}

export function setUpExplain(ctx) {
  const body = $("explain-body");
  const out = $("explain-out");
  $("explain-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    swap(out, h("p", { class: "meta" }, "asking…"));
    try {
      const d = await api.explain($("explain-path").value, body.value, $("explain-task").value.trim());
      swap(out, renderExplain(d));
    } catch (err) {
      const status = err.status ? `${err.status}${err.code ? ` ${err.code}` : ""}: ` : "";
      swap(out, h("p", { class: "error", role: "alert" }, `${status}${err.message}`));
    }
  });
  return (model) => {
    if (!body.value) body.value = JSON.stringify({ ...EXAMPLE, model }, null, 2);
  };
}
