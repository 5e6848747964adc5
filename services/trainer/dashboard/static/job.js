// A job's page: state and history, live curves, the latest rollout's samples, checkpoints and the log tail.
import { TERMINAL, el, fmtDuration, fmtTime, historyText, stateHistory } from "./api.js";
import { Curves } from "./charts.js";
import { SampleView } from "./samples.js";

function header(job, events, onCancel) {
  const spans = stateHistory(job, events);
  const cancel = TERMINAL.has(job.state) ? null
    : el("button", { type: "button", class: "danger", id: "cancel", onclick: onCancel }, "Cancel job");
  return el("div", { id: "job-header" },
    el("h1", {}, job.job_id, " ", el("span", { class: `state ${job.state}`, id: "job-state" }, job.state), " ", cancel),
    el("div", { class: "history" }, `rollout ${job.rollout_id + 1} / ${job.num_rollout} · submitted ${fmtTime(job.created_at)}` +
      (job.finished_at ? ` · ran ${fmtDuration(job.finished_at - job.created_at)} in all` : "")),
    el("div", { class: "history", id: "job-history" }, historyText(spans)),
    job.error ? el("pre", { class: "error" }, job.error) : null);
}

function checkpointList(info) {
  if (!info.save) return el("p", { class: "muted" }, "This job saves no checkpoints (no `save` in its spec).");
  if (!info.checkpoints.length) return el("p", { class: "muted" }, `None yet under ${info.save}.`);
  return el("table", {}, el("tr", {}, el("th", {}, "rollout"), el("th", {}, "path"), el("th", {}, "written")),
    ...info.checkpoints.map((c) => el("tr", {}, el("td", { class: "num" }, c.rollout_id + (c.rollout_id === info.latest ? " (latest)" : "")),
      el("td", {}, c.path), el("td", {}, fmtTime(c.time)))));
}

export async function renderJob({ main, poll, api }, jobId) {
  const base = `/v1/jobs/${encodeURIComponent(jobId)}`;
  const dash = `/v1/dashboard/jobs/${encodeURIComponent(jobId)}`;
  const head = el("div");
  const charts = el("div", { class: "charts", id: "charts" });
  const samplesBox = el("div");
  const checkpoints = el("div", { id: "checkpoints" });
  const log = el("pre", { id: "log" });
  const spec = el("pre", { id: "spec" });
  main.append(head, el("h2", {}, "Curves"), charts, el("h2", {}, "Samples of the latest rollout"), samplesBox,
    el("div", { class: "grid2" }, el("div", {}, el("h2", {}, "Checkpoints"), checkpoints),
      el("div", {}, el("h2", {}, "Log tail (trainer)"), log)),
    el("details", {}, el("summary", {}, "spec"), spec));
  const curves = new Curves(charts);
  const samples = new SampleView(samplesBox);
  const events = [];
  let samplesRollout = null;

  const cancel = async () => {
    if (!confirm(`Cancel job ${jobId}? A running job stops after its current step.`)) return;
    await api(`${base}/cancel`, { method: "POST" });
  };

  await poll(async () => {
    const job = await api(base);
    const after = events.length ? events[events.length - 1].seq : 0;
    const fresh = (await api(`${base}/events?after_seq=${after}`)).events;
    events.push(...fresh);
    curves.add(fresh);
    curves.draw();
    head.replaceChildren(header(job, events, () => cancel().catch((err) => alert(err.message))));
    if (!spec.textContent) spec.textContent = JSON.stringify(job.spec, null, 2);
    if (job.rollout_id !== samplesRollout || fresh.length) {
      const record = await api(`${dash}/samples`);
      if (record.rollout_id !== samplesRollout) { samples.set(record); samplesRollout = record.rollout_id; }
    }
    checkpoints.replaceChildren(checkpointList(await api(`${dash}/checkpoints`)));
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = (await api(`${dash}/log?lines=200`)).lines.join("\n") || "(nothing logged about this job yet)";
    if (atBottom) log.scrollTop = log.scrollHeight;
    return !(TERMINAL.has(job.state) && !fresh.length);
  });
}
