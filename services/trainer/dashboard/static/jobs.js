// The Jobs page: every job the trainer holds, newest first, with its spec, state history and durations.
import { el, fmtNum, fmtTime, historyText, stateHistory } from "./api.js";

const MAX_JOBS_WITH_HISTORY = 50;  // older jobs are listed without their events

function specDetails(spec) {
  const shown = Object.fromEntries(Object.entries(spec).filter(([, v]) => v !== null && v !== "" &&
    !(Array.isArray(v) && !v.length)));
  return el("details", {}, el("summary", {}, "spec"), el("pre", {}, JSON.stringify(shown, null, 2)));
}

function jobRow(job, events) {
  const spans = events ? stateHistory(job, events) : [];
  const reward = job.metrics["rollout/reward_mean"];
  const link = el("a", { href: `#/job/${encodeURIComponent(job.job_id)}`, class: "job-link" }, job.job_id);
  return el("tr", { "data-job": job.job_id },
    el("td", {}, link),
    el("td", {}, el("span", { class: `state ${job.state}` }, job.state)),
    el("td", { class: "num" }, `${job.rollout_id + 1} / ${job.num_rollout}`),
    el("td", { class: "num" }, fmtNum(reward)),
    el("td", { class: "num" }, fmtTime(job.created_at)),
    el("td", { class: "history" }, historyText(spans), job.error ? el("div", { class: "error" }, job.error) : null),
    el("td", {}, specDetails(job.spec)));
}

export async function renderJobs({ main, poll, api }) {
  const table = el("table", { id: "jobs" }, el("thead", {}, el("tr", {},
    ...["job", "state", "rollouts", "reward", "submitted", "state history (durations)", ""].map((h) => el("th", {}, h)))),
    el("tbody"));
  main.append(el("h1", {}, "Jobs"), table,
    el("p", { class: "muted" }, "Queued and running jobs first; finished ones after. Updates every 2 s."));
  const order = { RUNNING: 0, QUEUED: 1 };
  await poll(async () => {
    const { jobs } = await api("/v1/jobs");
    jobs.sort((a, b) => (order[a.state] ?? 2) - (order[b.state] ?? 2) || b.created_at - a.created_at);
    const histories = await Promise.all(jobs.map((job, i) => (i < MAX_JOBS_WITH_HISTORY
      ? api(`/v1/jobs/${encodeURIComponent(job.job_id)}/events`).then((r) => r.events) : null)));
    const rows = jobs.map((job, i) => jobRow(job, histories[i]));
    // keep open spec panels open across refreshes
    const open = new Set([...table.querySelectorAll("tr[data-job] details[open]")].map((d) => d.closest("tr").dataset.job));
    rows.forEach((row) => { if (open.has(row.dataset.job)) row.querySelector("details").open = true; });
    table.tBodies[0].replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 7, class: "muted" },
      "No jobs yet: submit one with `physarum submit JOB.yaml`."))]));
  });
}
