// The job API as the pages call it: the session's bearer token on every /v1 request, JSON both ways.
const TOKEN_KEY = "physarum.token";

export class AuthError extends Error {}

export const session = {
  get token() { return sessionStorage.getItem(TOKEN_KEY); },  // null: not signed in; "": no token needed
  set token(value) {
    if (value === null) sessionStorage.removeItem(TOKEN_KEY); else sessionStorage.setItem(TOKEN_KEY, value);
  },
};

export async function api(path, { method = "GET", body } = {}) {
  const headers = { accept: "application/json" };
  if (session.token) headers.authorization = `Bearer ${session.token}`;
  if (body !== undefined) headers["content-type"] = "application/json";
  const reply = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (reply.status === 401) throw new AuthError("the job API refused the token");
  const data = await reply.json().catch(() => ({}));
  if (!reply.ok) throw new Error(`${method} ${path}: ${reply.status} ${data.detail || reply.statusText}`);
  return data;
}

// Small DOM helpers: el("td", {class: "num"}, "1.0") builds an element; text is never parsed as HTML.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value); else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== undefined && child !== null) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function fmtTime(unixS) {
  return unixS ? new Date(unixS * 1000).toLocaleTimeString() : "-";
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || seconds < 0) return "-";
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
}

export function fmtNum(value, digits = 3) {
  if (value === undefined || value === null) return "-";
  return Math.abs(value) >= 1000 ? value.toFixed(0) : value.toFixed(digits);
}

// The state history from a job's events: each change of state with when it began and how long it lasted.
export function stateHistory(job, events) {
  const spans = [];
  for (const event of events) {
    if (!spans.length || spans[spans.length - 1].state !== event.state) spans.push({ state: event.state, start: event.time });
  }
  const end = job.finished_at || Date.now() / 1000;
  spans.forEach((span, i) => {
    const terminal = ["SUCCEEDED", "FAILED", "CANCELLED"].includes(span.state);
    span.seconds = terminal ? null : (i + 1 < spans.length ? spans[i + 1].start : end) - span.start;
  });
  return spans;
}

export function historyText(spans) {
  return spans.map((s) => (s.seconds === null ? s.state : `${s.state} ${fmtDuration(s.seconds)}`)).join(" → ");
}

export const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
