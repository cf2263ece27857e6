// DOM helpers and formatting. Data only ever reaches the page as text nodes and attribute values (never as HTML),
// so nothing the gateway reports (a reason, an error, a URL) can inject markup or script.

const SVG = "http://www.w3.org/2000/svg";

// h("td", {class: "num", "data-key": k}, "text", node, [more]) -> element
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function text(id, value) {
  const el = document.getElementById(id);
  if (el.textContent !== value) el.textContent = value;
}

// Replace a container's children in one step (no paint in between: no flicker), and give keyboard focus back to
// the control that had it (matched by its data-key) when it is still there.
export function swap(container, ...children) {
  const active = document.activeElement;
  const key = active && container.contains(active) ? active.getAttribute("data-key") : null;
  container.replaceChildren(...children.flat(Infinity).filter((c) => c));
  if (key) {
    const again = container.querySelector(`[data-key="${CSS.escape(key)}"]`);
    if (again) again.focus({ preventScroll: true });
  }
}

export function num(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toFixed(digits);
}

export function pct(x) {
  if (x === null || x === undefined) return "–";
  return `${(100 * x).toFixed(0)}%`;
}

// Seconds as "45s", "12m 03s", "3h 20m", "2d 4h".
export function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.max(0, Math.round(s));
  const two = (n) => String(n).padStart(2, "0");
  if (s < 60) return `${s}s`;
  if (s < 3600) return s % 60 ? `${Math.floor(s / 60)}m ${two(s % 60)}s` : `${s / 60}m`;
  if (s < 86400) return s % 3600 ? `${Math.floor(s / 3600)}h ${two(Math.floor((s % 3600) / 60))}m` : `${s / 3600}h`;
  return s % 86400 ? `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h` : `${s / 86400}d`;
}

// A TTL as the gateway's default is written back into the form: "1h", "30m", "90s".
export function ttlText(s) {
  if (s % 86400 === 0) return `${s / 86400}d`;
  if (s % 3600 === 0) return `${s / 3600}h`;
  if (s % 60 === 0) return `${s / 60}m`;
  return `${s}s`;
}

// What a typed TTL means, for the confirmation: "for 30m", "until someone removes it", or null if unreadable.
export function ttlMeaning(raw, defaultS) {
  const t = (raw || "").trim().toLowerCase();
  if (t === "") return `for ${duration(defaultS)} (the default)`;
  if (t === "never") return "until someone removes it";
  const m = /^(\d+(?:\.\d+)?)\s*([smhd]?)$/.exec(t);
  if (!m) return null;
  const unit = { "": 1, s: 1, m: 60, h: 3600, d: 86400 }[m[2]];
  return `for ${duration(Number(m[1]) * unit)}`;
}

export function clock(epochS) {
  if (!epochS) return "–";
  const d = new Date(epochS * 1000);
  return d.toLocaleString(undefined, { hour12: false });
}

// A small line chart of the last values (null = unknown: a gap), scaled to [0, max].
export function sparkline(values, label, max) {
  const w = 120;
  const hgt = 28;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${hgt}`);
  svg.setAttribute("class", "spark");
  svg.setAttribute("role", "img");
  const known = values.filter((v) => v !== null && v !== undefined);
  const top = max !== undefined ? max : Math.max(1, ...known);
  const last = known.length ? known[known.length - 1] : null;
  svg.setAttribute("aria-label", `${label}: ${last === null ? "unknown" : num(last, 2)} now`);
  const title = document.createElementNS(SVG, "title");
  title.textContent = `${label}, last ${values.length} refreshes (max ${num(top, 2)})`;
  svg.append(title);
  const base = document.createElementNS(SVG, "line");
  for (const [k, v] of Object.entries({ x1: 0, y1: hgt - 1, x2: w, y2: hgt - 1, class: "axis" })) base.setAttribute(k, v);
  svg.append(base);
  const step = values.length > 1 ? w / (values.length - 1) : w;
  let points = [];
  const flush = () => {
    if (points.length) {
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("points", points.join(" "));
      svg.append(line);
    }
    points = [];
  };
  values.forEach((v, i) => {
    if (v === null || v === undefined) flush();
    else points.push(`${(i * step).toFixed(1)},${(hgt - 2 - (Math.min(v, top) / top) * (hgt - 4)).toFixed(1)}`);
  });
  flush();
  return svg;
}

// Each cell gets its column's name as data-label: on a phone the stylesheet stacks the rows and shows it.
export function labelled(table) {
  const names = [...table.querySelectorAll("thead th")].map((th) => (th.querySelector(".sr-only") ? "" : th.textContent));
  for (const tr of table.querySelectorAll("tbody tr")) {
    [...tr.children].forEach((cell, i) => {
      if (names[i] && !cell.hasAttribute("colspan")) cell.setAttribute("data-label", names[i]);
    });
  }
  return table;
}

// Epoch seconds as a time of day when it is today, else date and time.
export function when(epochS) {
  const d = new Date(epochS * 1000);
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString(undefined, { hour12: false }) : d.toLocaleString(undefined, { hour12: false });
}

export function badge(label, kind) {
  return h("span", { class: `badge ${kind || ""}` }, label);
}
