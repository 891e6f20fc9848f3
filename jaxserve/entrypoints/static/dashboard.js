// The live dashboard: polls GET /metrics/summary (the server's metrics as JSON) once a second
// while the tab is visible, shows its gauges and counters, plots output tokens/s over the last
// SPAN_S seconds (counter deltas between polls) and the latency histograms since start.

import {apiFetch} from "./api.js";
import {barChart, lineChart} from "./charts.js";

const POLL_MS = 1000;
const SPAN_S = 120;
const $ = id => document.getElementById(id);
const points = [];  // {t: server time (s), v: output tokens/s over the poll before t}
let prev = null;  // the previous summary

const percent = x => (x === null ? "–" : `${(100 * x).toFixed(1)}%`);
const seconds = s => (s < 1 ? `${+(s * 1000).toPrecision(3)}ms` : `${+s.toPrecision(3)}s`);

// A histogram (summary form: le bounds, per-bucket counts, count, sum in seconds) as bars.
function histogram(name, h) {
  const labels = [...h.le.map(seconds), `>${seconds(h.le[h.le.length - 1])}`];
  barChart($(`${name}-chart`), labels, h.counts);
  $(`${name}-note`).textContent = h.count
    ? `${h.count} observed, mean ${seconds(h.sum / h.count)}` : "none yet";
}

function show(s) {
  $("m-running").textContent = s.requests_running;
  $("m-waiting").textContent = s.requests_waiting;
  $("m-kv").textContent = percent(s.kv_cache_usage);
  $("m-hit-rate").textContent = percent(s.prefix_cache_hit_rate);
  $("m-finished").textContent = s.requests_finished;
  $("m-tokens").textContent = s.generation_tokens;
  if (prev && s.time > prev.time) {
    // A restarted server counts from 0 again: no negative rate.
    const rate = Math.max(0, (s.generation_tokens - prev.generation_tokens) / (s.time - prev.time));
    points.push({t: s.time, v: rate});
    $("tps-now").textContent = `now ${rate.toFixed(1)}`;
  }
  prev = s;
  while (points.length && points[0].t < s.time - SPAN_S) points.shift();
  lineChart($("tps-chart"), points, SPAN_S);
  histogram("ttft", s.time_to_first_token_seconds);
  histogram("itl", s.inter_token_latency_seconds);
}

// Starts polling; onStatus(text, ok) tells the engine's state.
export function startDashboard(onStatus) {
  const tick = async () => {
    if (!document.hidden) {
      try {
        const s = await (await apiFetch("/metrics/summary")).json();
        onStatus(s.engine_alive ? "engine ready" : "engine down", s.engine_alive);
        show(s);
      } catch (e) {
        onStatus(e.status === 503 ? "engine starting" : "server unreachable", false);
      }
    }
    setTimeout(tick, POLL_MS);
  };
  tick();
}
