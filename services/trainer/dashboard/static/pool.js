// The Pool and the Buffer: engines with health, weight version and load, their join/leave events, scaling; the
// buffer's counters for a job (prompt queue, leases, groups waiting) and its stale groups.
import { el, fmtNum, fmtTime } from "./api.js";

function engineRows(pool) {
  return pool.engines.map((e) => el("tr", { "data-engine": e.name },
    el("td", {}, e.name), el("td", {}, el("span", { class: `state ${e.state}` }, e.state)),
    el("td", {}, e.healthy ? "healthy" : el("span", { class: "error" }, "unhealthy")),
    el("td", { class: "num" }, e.weight_version || "-"), el("td", { class: "num" }, e.load),
    el("td", {}, e.url), el("td", { class: "muted" }, e.external ? "external" : e.pid ? `pid ${e.pid}` : "")));
}

function poolSummary(pool) {
  return `${pool.engines.length} engines (${pool.desired_replicas} wanted); trainer's weight version ` +
    `${pool.weight_version || "-"}; joining by ${pool.join_mode}${pool.weight_sync_in_progress ? "; weight sync under way" : ""}`;
}

function bufferTable(info) {
  if (!info.stats) return el("p", { class: "muted" }, `The buffer holds no dataset for ${info.job_id} (yet).`);
  const s = info.stats;
  const rows = [["prompts in the dataset", s.num_prompts], ["epoch", s.epoch], ["cursor (next prompt)", s.cursor],
    ["prompts leased (being generated)", s.num_leased], ["prompts returned (queued to lease again)", s.num_returned],
    ["sample groups written (this job)", s.num_groups],
    ...Object.entries(info.stale).map(([k, v]) => [k, fmtNum(v)])];
  return el("table", { id: "buffer-stats" }, ...rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", { class: "num" }, v))));
}

export async function renderPool({ main, poll, api, fail }) {
  const summary = el("p", { id: "pool-summary", class: "muted" });
  const engines = el("tbody");
  const events = el("tbody");
  const replicas = el("input", { type: "number", min: 0, id: "replicas", size: 4 });
  const scale = async () => {
    const n = Number(replicas.value);
    if (replicas.value === "" || !Number.isInteger(n) || n < 0) { alert("replicas: a whole number >= 0"); return; }
    if (!confirm(`Scale the engine pool to ${n} engines?`)) return;
    await api("/v1/dashboard/pool/scale", { method: "POST", body: { replicas: n } });
  };
  const jobSelect = el("select", { id: "buffer-job" });
  const buffer = el("div", { id: "buffer" });
  main.append(el("h1", {}, "Engine pool"), summary,
    el("div", { class: "controls" }, el("label", {}, "engines wanted ", replicas),
      el("button", { type: "button", id: "scale", onclick: () => scale().catch(fail) }, "Scale")),
    el("table", { id: "engines" }, el("thead", {}, el("tr", {},
      ...["engine", "state", "health", "weight version", "load", "url", ""].map((h) => el("th", {}, h)))), engines),
    el("h2", {}, "Join and leave events"),
    el("table", { id: "pool-events" }, el("thead", {}, el("tr", {},
      ...["time", "event", "engine", "detail"].map((h) => el("th", {}, h)))), events),
    el("h1", {}, "Buffer"), el("div", { class: "controls" }, el("label", {}, "job ", jobSelect)), buffer);
  jobSelect.addEventListener("change", () => { jobSelect.dataset.chosen = jobSelect.value; });

  await poll(async () => {
    const pool = await api("/v1/dashboard/pool");
    summary.textContent = poolSummary(pool);
    if (document.activeElement !== replicas) replicas.value = pool.desired_replicas;
    engines.replaceChildren(...engineRows(pool));
    events.replaceChildren(...pool.events.slice().reverse().map((e) => el("tr", {}, el("td", {}, fmtTime(e.time_s)),
      el("td", {}, e.kind), el("td", {}, e.engine), el("td", { class: "muted" }, e.detail))));
    const { jobs } = await api("/v1/jobs");
    const ids = jobs.sort((a, b) => (a.state === "RUNNING" ? -1 : 0) - (b.state === "RUNNING" ? -1 : 0) ||
      b.created_at - a.created_at).map((j) => j.job_id);
    const chosen = ids.includes(jobSelect.dataset.chosen) ? jobSelect.dataset.chosen : ids[0];
    jobSelect.replaceChildren(...ids.map((id) => el("option", { value: id, selected: id === chosen }, id)));
    if (chosen) buffer.replaceChildren(bufferTable(await api(`/v1/dashboard/buffer/${encodeURIComponent(chosen)}`)));
    else buffer.replaceChildren(el("p", { class: "muted" }, "No jobs yet."));
  });
}
