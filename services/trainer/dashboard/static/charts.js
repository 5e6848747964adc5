// A job's curves: one uPlot chart per group of metric keys, x = rollout id, redrawn as events bring new points.
const GROUPS = [
  { id: "reward", title: "Reward (train and held-out eval)", keys: /^rollout\/reward_mean$|^eval\/(?!step$)/ },
  { id: "loss", title: "Loss terms", keys: /^train\/.*loss$/ },
  { id: "kl", title: "KL", keys: /kl(?!.*loss$)/ },
  { id: "entropy", title: "Entropy", keys: /entropy(?!.*loss$)/ },
  { id: "grad_norm", title: "Grad norm", keys: /grad_norm/ },
  { id: "clipfrac", title: "Clip fraction", keys: /clipfrac/ },
  { id: "response_len", title: "Response length (tokens)", keys: /response_len|truncated_ratio/ },
  { id: "staleness", title: "Staleness", keys: /staleness|^buffer\/stale_/ },
  { id: "throughput", title: "Throughput", keys: /per_second/ },
  { id: "step_time", title: "Step time (s)", keys: /^perf\/.*_seconds$/ },
];
const COLORS = ["#0b62d6", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0c8599", "#c2255c", "#5c940d", "#495057"];
const WIDTH = 420;

// A flat series (all rewards 0 early on) gets a small band around its value, not uPlot's 0..100.
function yRange(u, min, max) {
  if (min === null || max === null) return [0, 1];
  if (min === max) return [min - Math.max(Math.abs(min) * 0.1, 0.1), max + Math.max(Math.abs(max) * 0.1, 0.1)];
  return uPlot.rangeNum(min, max, 0.1, true);
}

function shortNumber(value) {
  return value === null ? "" : Math.abs(value) >= 1e4 || (value !== 0 && Math.abs(value) < 1e-3)
    ? value.toExponential(1) : String(+value.toPrecision(3));
}

export class Curves {
  constructor(container) {
    this.container = container;
    this.rows = new Map();  // rollout id -> merged metrics of that rollout's events
    this.charts = new Map();  // group id -> {plot, keys, node}
  }

  add(events) {
    for (const event of events) {
      if (event.rollout_id < 0 || !Object.keys(event.metrics).length) continue;
      this.rows.set(event.rollout_id, { ...(this.rows.get(event.rollout_id) || {}), ...event.metrics });
    }
  }

  // Number of points of a group's chart (the tests read it from the DOM's data-points).
  draw() {
    const xs = [...this.rows.keys()].sort((a, b) => a - b);
    const allKeys = new Set(xs.flatMap((x) => Object.keys(this.rows.get(x))));
    for (const group of GROUPS) {
      const keys = [...allKeys].filter((k) => group.keys.test(k)).sort();
      if (!keys.length) continue;
      const xsWith = xs.filter((x) => keys.some((k) => k in this.rows.get(x)));
      const data = [xsWith, ...keys.map((k) => xsWith.map((x) => this.rows.get(x)[k] ?? null))];
      let chart = this.charts.get(group.id);
      if (chart && chart.keys.join() !== keys.join()) { chart.plot.destroy(); chart.node.remove(); chart = null; }
      if (!chart) chart = this.create(group, keys);
      chart.plot.setData(data);
      chart.node.dataset.points = String(xsWith.length);
    }
  }

  create(group, keys) {
    const node = document.createElement("div");
    node.className = "chart";
    node.dataset.group = group.id;
    const title = document.createElement("h3");
    title.textContent = group.title;
    node.append(title);
    const order = GROUPS.findIndex((g) => g.id === group.id);
    const after = [...this.container.children].find((c) => GROUPS.findIndex((g) => g.id === c.dataset.group) > order);
    this.container.insertBefore(node, after || null);
    const opts = {
      width: WIDTH, height: 200,
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [{ label: "rollout", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] }, { size: 60, values: (u, ticks) => ticks.map(shortNumber) }],
      series: [{ label: "rollout" }, ...keys.map((key, i) => ({ label: key, stroke: COLORS[i % COLORS.length],
        width: 1.5, points: { show: true, size: 4 }, spanGaps: true }))],
      legend: { live: false },  // names only: a compact legend under each chart
    };
    const plot = new uPlot(opts, [[], ...keys.map(() => [])], node);
    const chart = { plot, keys, node };
    this.charts.set(group.id, chart);
    return chart;
  }
}
