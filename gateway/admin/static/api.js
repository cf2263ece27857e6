// The admin API as the console calls it: the token from this tab's sessionStorage sent as Bearer, no cookies,
// and every refusal turned into an ApiError carrying the API's own message, code and (for a reload) its list of
// path-named errors, so the page can show them verbatim.

const TOKEN_KEY = "specgate.admin.token";
const ACTOR_KEY = "specgate.admin.actor";

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function actor() {
  return sessionStorage.getItem(ACTOR_KEY) || "";
}

export function signIn(newToken, newActor) {
  sessionStorage.setItem(TOKEN_KEY, newToken);
  if (newActor) sessionStorage.setItem(ACTOR_KEY, newActor);
  else sessionStorage.removeItem(ACTOR_KEY);
}

export function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, message, code, issues, body) {
    super(message);
    this.status = status;
    this.code = code;
    this.issues = issues; // [{path, line, message}] for a refused reload, else []
    this.body = body;
  }
}

function headers(hasBody) {
  const h = { Accept: "application/json" };
  const t = token();
  if (t) h.Authorization = `Bearer ${t}`;
  const a = actor();
  if (a) h["X-Specgate-Actor"] = `${a} (console)`;
  else h["X-Specgate-Actor"] = "console";
  if (hasBody) h["Content-Type"] = "application/json";
  return h;
}

// method, path (from /admin/...), optional JSON body; extra headers (explain's X-Task-Type).
export async function call(method, path, body, extra) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: { ...headers(body !== undefined), ...(extra || {}) },
      body: body === undefined ? undefined : typeof body === "string" ? body : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
      redirect: "error",
    });
  } catch (err) {
    throw new ApiError(0, `cannot reach the admin API: ${err.message}`, "unreachable", [], null);
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const e = data && typeof data === "object" && data.error && typeof data.error === "object" ? data.error : null;
    const message = e && typeof e.message === "string" ? e.message : `HTTP ${response.status}: ${text.slice(0, 500)}`;
    const issues = e && Array.isArray(e.errors) ? e.errors : [];
    throw new ApiError(response.status, message, e ? e.code : null, issues, data);
  }
  return data;
}

export const get = (path) => call("GET", path);

const enc = encodeURIComponent;

export const api = {
  state: () => get("/admin/state"),
  audit: (limit) => get(`/admin/audit?limit=${limit}`),
  config: () => get("/admin/config"),
  explain: (path, body, taskType) =>
    call("POST", `/admin/explain?path=${enc(path)}`, body, taskType ? { "X-Task-Type": taskType } : undefined),
  reload: () => call("POST", "/admin/reload"),
  poolWeight: (pool, weight, ttl, reason) =>
    call("PUT", `/admin/pools/${enc(pool)}/weight`, withTtl({ weight, reason }, ttl)),
  endpointWeight: (pool, endpoint, weight, ttl, reason) =>
    call("PUT", `/admin/pools/${enc(pool)}/endpoints/${enc(endpoint)}/weight`, withTtl({ weight, reason }, ttl)),
  drain: (pool, ttl, reason) => call("POST", `/admin/pools/${enc(pool)}/drain`, withTtl({ reason }, ttl)),
  undrain: (pool, reason) => call("POST", `/admin/pools/${enc(pool)}/undrain`, { reason }),
  classRoute: (klass, route, ttl, reason) =>
    call("PUT", `/admin/classes/${enc(klass)}/route`, withTtl({ route, reason }, route === "auto" ? "" : ttl)),
  removeOverride: (id, reason) => call("DELETE", `/admin/overrides/${enc(id)}?reason=${enc(reason)}`),
};

// The TTL as typed: a plain number is seconds, anything else ("30m", "never") goes as the string; empty: the
// gateway's default (the field is left out).
function withTtl(body, ttl) {
  const t = (ttl || "").trim();
  if (t === "") return body;
  return { ...body, ttl: /^\d+(\.\d+)?$/.test(t) ? Number(t) : t };
}
