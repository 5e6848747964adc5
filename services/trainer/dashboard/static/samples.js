// The latest rollout's samples, filterable by reward; a prompt's images show beside its text, and a multi-turn
// response shows turn by turn, masked parts marked. An agent sample's session opens on demand as its agent saw it:
// each turn's new messages (tool results among them), the reply with its tool calls, and which turns are trained.
import { api, el, fmtNum } from "./api.js";

function turnsOf(sample) {
  const parts = sample.prompt_messages.length
    ? sample.prompt_messages.map((m) => el("div", { class: "turn prompt" }, el("span", { class: "label" }, m.role || "message"), m.content))
    : [el("div", { class: "turn prompt" }, el("span", { class: "label" }, "prompt"), sample.prompt)];
  if (sample.images && sample.images.length) {
    parts.push(el("div", { class: "images" }, ...sample.images.map((src, i) =>
      el("figure", {}, el("img", { class: "sample-image", src, alt: `image ${i + 1}` }), el("figcaption", {}, `image ${i + 1}`)))));
  }
  const multi = sample.turns.length > 1;
  sample.turns.forEach((turn, i) => {
    const label = turn.masked ? `masked: not trained on (${turn.num_tokens} tokens)`
      : multi ? `model, turn ${i + 1} (${turn.num_tokens} tokens)` : `response (${turn.num_tokens} tokens)`;
    parts.push(el("div", { class: `turn response${turn.masked ? " masked" : ""}` }, el("span", { class: "label" }, label),
      turn.text));
  });
  return parts;
}

function messageBox(message, kind) {
  const role = message.role === "tool" ? `tool result${message.tool_call_id ? ` for ${message.tool_call_id}` : ""}`
    : message.role;
  const calls = message.tool_calls.map((call) => el("div", { class: "tool-call", "data-name": call.name },
    el("span", { class: "label" }, `tool call ${call.id}`), `${call.name}(${call.arguments})`));
  const more = message.num_tool_calls > calls.length ? el("div", { class: "muted" },
    `… ${message.num_tool_calls - calls.length} more tool calls`) : null;
  return el("div", { class: `msg ${kind}`, "data-role": message.role },
    el("span", { class: "label" }, kind === "reply" ? "assistant reply (the model's tokens)" : role),
    message.text ? el("div", { class: "text" }, message.text) : null, ...calls, more);
}

function sessionTurn(turn) {
  const trained = turn.trained ? `trained: loss_mask 1 on its ${turn.generated_tokens} tokens`
    : `not trained: ${turn.generated_tokens} tokens off the sample's path (a branch or another choice)`;
  const head = [`turn ${turn.index}`, turn.parent >= 0 ? `continues turn ${turn.parent}` : "starts the session",
    trained, `finish ${turn.finish || "-"}`].join(" · ");
  const hidden = turn.num_messages - turn.messages.length;
  return el("div", { class: `agent-turn${turn.trained ? " trained" : ""}`, "data-turn": turn.index,
    "data-trained": String(turn.trained) },
  el("div", { class: "agent-turn-head" }, head),
  turn.branch ? el("div", { class: "turn branch" }, el("span", { class: "label" }, "starts a branch"), turn.branch) : null,
  hidden > 0 ? el("div", { class: "muted" }, `… ${hidden} earlier messages of the request not shown`) : null,
  turn.messages.length ? el("div", { class: "label" }, turn.parent >= 0
    ? `the request's new messages: ${turn.context_tokens} tokens, loss_mask 0`
    : `the prompt: ${turn.context_tokens} tokens, not in the loss`) : null,
  ...turn.messages.map((m) => messageBox(m, "sent")),
  turn.reply ? messageBox(turn.reply, "reply") : null);
}

function sessionView(transcript) {
  const links = [transcript.parent_session ? `spawned from session ${transcript.parent_session}` : null,
    transcript.spawned.length ? `spawned sessions ${transcript.spawned.join(", ")} (a sample each)` : null];
  const hidden = transcript.num_turns - transcript.turns.length;
  return el("div", { class: "agent-session", "data-session": transcript.session },
    el("div", { class: "meta" }, el("span", {}, `session ${transcript.session}`),
      ...links.filter(Boolean).map((text) => el("span", { class: "spawn" }, text))),
    ...transcript.turns.map(sessionTurn),
    hidden > 0 ? el("div", { class: "muted" }, `… ${hidden} later turns not shown`) : null);
}

function sessionDetails(record, position, sample) {
  const body = el("div", {}, "loading…");
  let loaded = false;
  const details = el("details", { class: "session" }, el("summary", {},
    `the agent's session: ${sample.agent_turns} turns, as the agent saw them`), body);
  details.addEventListener("toggle", async () => {
    if (!details.open || loaded) return;
    loaded = true;
    try {
      const path = `/v1/dashboard/jobs/${encodeURIComponent(record.job_id)}/samples/${position}/session` +
        `?rollout_id=${record.rollout_id}`;
      body.replaceChildren(sessionView(await api(path)));
    } catch (err) {
      loaded = false;
      body.replaceChildren(el("span", { class: "error" }, err.message));
    }
  });
  return details;
}

function sampleCard(sample, record, position) {
  const reward = el("span", { class: `reward${sample.reward > 0 ? " pos" : ""}` }, `reward ${fmtNum(sample.reward)}`);
  return el("div", { class: "sample", "data-reward": sample.reward },
    el("div", { class: "meta" }, reward, el("span", {}, `group ${sample.group_index} · sample ${sample.index}`),
      el("span", {}, `${sample.response_length} response tokens`),
      el("span", {}, `weight version ${sample.weight_versions.join(", ") || "-"}`), el("span", {}, sample.status),
      sample.reward_error ? el("span", { class: "error" }, sample.reward_error) : null,
      sample.agent_turns != null ? el("span", {}, `agent session: ${sample.agent_turns} turns`) : null),
    ...(sample.agent_branches || []).map((b) => el("div", { class: "turn branch" }, el("span", { class: "label" },
      `branch at turn ${b.turn}`), b.reason)),
    ...turnsOf(sample),
    sample.has_session ? sessionDetails(record, position, sample) : null);
}

export class SampleView {
  constructor(container) {
    this.list = el("div", { id: "samples" });
    this.summary = el("span", { class: "muted" });
    this.min = el("input", { type: "number", step: "any", id: "reward-min", placeholder: "min", size: 6 });
    this.max = el("input", { type: "number", step: "any", id: "reward-max", placeholder: "max", size: 6 });
    for (const input of [this.min, this.max]) {
      for (const kind of ["input", "change"]) input.addEventListener(kind, () => this.draw());
    }
    container.append(el("div", { class: "controls" }, el("label", {}, "reward from ", this.min), el("label", {}, " to ", this.max),
      this.summary), this.list);
    this.rollout = null;
  }

  set(record) {
    this.rollout = record;
    this.draw();
  }

  draw() {
    const record = this.rollout;
    if (!record || record.rollout_id < 0) { this.summary.textContent = "no rollout finished yet"; return; }
    const lo = this.min.value === "" ? -Infinity : Number(this.min.value);
    const hi = this.max.value === "" ? Infinity : Number(this.max.value);
    const shown = record.samples.filter((s) => s.reward >= lo && s.reward <= hi);
    this.summary.textContent = `rollout ${record.rollout_id}: ${shown.length} of ${record.samples.length} shown` +
      (record.num_samples > record.samples.length ? ` (the rollout had ${record.num_samples})` : "");
    this.list.replaceChildren(...shown.map((s) => sampleCard(s, record, record.samples.indexOf(s))));
  }
}
