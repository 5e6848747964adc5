// The latest rollout's samples, filterable by reward; a prompt's images show beside its text, and a multi-turn
// response shows turn by turn, masked parts marked.
import { el, fmtNum } from "./api.js";

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

function sampleCard(sample) {
  const reward = el("span", { class: `reward${sample.reward > 0 ? " pos" : ""}` }, `reward ${fmtNum(sample.reward)}`);
  return el("div", { class: "sample", "data-reward": sample.reward },
    el("div", { class: "meta" }, reward, el("span", {}, `group ${sample.group_index} · sample ${sample.index}`),
      el("span", {}, `${sample.response_length} response tokens`),
      el("span", {}, `weight version ${sample.weight_versions.join(", ") || "-"}`), el("span", {}, sample.status),
      sample.reward_error ? el("span", { class: "error" }, sample.reward_error) : null,
      sample.agent_turns != null ? el("span", {}, `agent session: ${sample.agent_turns} turns`) : null),
    ...(sample.agent_branches || []).map((b) => el("div", { class: "turn branch" }, el("span", { class: "label" },
      `branch at turn ${b.turn}`), b.reason)),
    ...turnsOf(sample));
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
    this.list.replaceChildren(...shown.map(sampleCard));
  }
}
