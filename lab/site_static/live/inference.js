// Chapter 11's inference explorer, live: one decode step on a chip's roofline, moved by batch and context.
// The controls and the two charts are lab/widgets/inference.py's; every point is `python -m lab calc inference
// --json` at one batch of the sweep (prefill at --mfu 1, at its roof like the widget's).
//
// Left: the decode step's time against the batch. The memory time (weights + KV cache read once) barely moves at
// small batch while the compute time grows in proportion; reading the weights and the weight matmuls (dashed) cross
// at the critical batch. Right: decode tokens/s, which approach prefill's rate only past it. Shaded: batches whose
// KV cache does not fit beside the weights.

import {argv, ask, axes, chart, el, fmt, legend, line, live, scale, seconds, svg, value} from "./ui.js";

const MODELS = ["tiny", "tiny-moe", "smollm-135m", "llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b",
                "mixtral-8x7b", "deepseek-v3"];
const BATCHES = Array.from({length: 13}, (_, k) => 2 ** k);  // 1 .. 4,096 sequences decoding together
const CONTEXTS = Array.from({length: 11}, (_, k) => 2 ** (k + 7));  // 128 .. 131,072 tokens
const XLIM = [0.8, 5000];
const MEMORY = "#1565c0";
const COMPUTE = "#c62828";

const SPECS = [
  {name: "--model", label: "model", kind: "select", options: MODELS, value: "llama3-8b"},
  {name: "--hardware", label: "chip", kind: "select", options: ["h100", "h200", "a100", "b200", "tpu-v5e", "tpu-v5p"],
   value: "h100"},
  {name: "--tp", label: "tp (chips)", kind: "select", options: [1, 2, 4, 8, 16], value: 1},
  {name: "--kv-dtype", label: "KV dtype", kind: "select", options: ["bf16", "fp8", "int4"], value: "bf16"},
  {name: "--batch", label: "batch", kind: "select", options: BATCHES, value: 1},
  {name: "--seq", label: "context", kind: "select", options: CONTEXTS, value: 4096},
];

export async function mount(root, calc) {
  await live(root, calc, {specs: SPECS, ask: sweep, draw});

  async function sweep(values) {
    const fixed = Object.entries(values).filter(([flag]) => flag !== "--batch");
    return Promise.all(BATCHES.map((batch) => ask(calc, argv("inference", [...fixed, ["--batch", batch],
                                                                             ["--mfu", 1]]))));
  }
}

function draw(rows, values, view) {
  const chosen = rows[BATCHES.indexOf(Number(values["--batch"]))];
  const s = chosen.step;
  const prefillRate = chosen.context / chosen.prefill_s;
  const fit = chosen.max_sequences;
  const time = chart(400, 300, {title: "ms per decode step against the batch"});
  const x = scale(...XLIM, time.box.left, time.box.right, 10);
  const ms = (key) => rows.map((r) => r.step[key] * 1e3);
  const all = [...ms("latency_bound_s"), ...ms("compute_s"), ...ms("linear_s")].filter((t) => t > 0);
  const y = scale(Math.min(...all) / 1.5, Math.max(...all) * 1.5, time.box.bottom, time.box.top, 10);
  axes(time, x, y, {xlabel: "batch (sequences decoding together)", ylabel: "ms per decode step"});
  shadeUnfit(time, x, fit);
  criticalBatch(time, x, chosen.critical_batch);
  const curve = (key, attrs) => line(x, y, BATCHES.map((b, i) => [b, ms(key)[i]]), {
    "data-key": `curve.${key}`, "data-value": JSON.stringify(rows.map((r) => r.step[key])), ...attrs});
  time.svg.append(curve("latency_bound_s", {stroke: MEMORY, "stroke-width": 1.8}),
                  curve("compute_s", {stroke: COMPUTE, "stroke-width": 1.8}),
                  curve("time_s", {stroke: "black", "stroke-width": 3, opacity: 0.45}),
                  curve("weights_s", {stroke: MEMORY, "stroke-dasharray": "5 3"}),
                  curve("linear_s", {stroke: COMPUTE, "stroke-dasharray": "5 3"}),
                  marker(x(s.batch), y(s.time_s * 1e3), "time_s", s.time_s));

  const rate = chart(400, 300, {title: "tokens/s against the batch"});
  const tokens = rows.map((r) => r.tokens_per_s);
  const ry = scale(Math.min(...tokens, prefillRate) / 1.5, Math.max(...tokens, prefillRate) * 1.5, rate.box.bottom,
                   rate.box.top, 10);
  axes(rate, x, ry, {xlabel: "batch (sequences decoding together)", ylabel: "tokens/s (all chips)"});
  shadeUnfit(rate, x, fit);
  criticalBatch(rate, x, chosen.critical_batch);
  rate.svg.append(line(x, ry, BATCHES.map((b, i) => [b, tokens[i]]), {stroke: "black", "stroke-width": 1.8,
                                                                     "data-key": "curve.tokens_per_s",
                                                                     "data-value": JSON.stringify(tokens)}),
                  svg("line", {x1: rate.box.left, x2: rate.box.right, y1: ry(prefillRate), y2: ry(prefillRate),
                               stroke: "#2e7d32", "stroke-dasharray": "5 3"}),
                  marker(x(s.batch), ry(chosen.tokens_per_s), "tokens_per_s", chosen.tokens_per_s));
  view.plot.replaceChildren(el("div", {class: "live-charts"}, time.svg, rate.svg), legend([
    ["memory time (weights + KV)", MEMORY], ["compute time (at peak)", COMPUTE], ["step time", "#8c8c8c"],
    ["weights read", MEMORY, true], ["weight matmuls", COMPUTE, true], ["prefill (one prompt, at peak)", "#2e7d32", true],
    ["critical batch", "#9e9e9e", true], ["does not fit in HBM", "#e0e0e0"]]));
  summarise(chosen, values, prefillRate, view);
}

function shadeUnfit(c, x, fit) {
  if (fit >= BATCHES[BATCHES.length - 1]) return;
  const from = x(Math.max(fit, XLIM[0]));
  c.svg.append(svg("rect", {x: from, y: c.box.top, width: c.box.right - from, height: c.box.bottom - c.box.top,
                            fill: "#9e9e9e", opacity: 0.18, "data-key": "max_sequences",
                            "data-value": JSON.stringify(fit)}));
}

function criticalBatch(c, x, batch) {
  if (batch < XLIM[0] || batch > XLIM[1]) return;
  c.svg.append(svg("line", {x1: x(batch), x2: x(batch), y1: c.box.top, y2: c.box.bottom, stroke: "#9e9e9e",
                            "stroke-dasharray": "2 3"}));
}

function marker(cx, cy, key, exact) {
  return svg("circle", {cx, cy, r: 4, class: "live-marker", "data-key": `marker.${key}`,
                        "data-value": JSON.stringify(exact)});
}

function summarise(a, values, prefillRate, view) {
  const s = a.step;
  const chips = a.tp > 1 ? `${a.tp} × ${values["--hardware"]}` : values["--hardware"];
  const binds = s.latency_bound_s >= s.compute_s ? "memory" : "compute";
  view.summary.replaceChildren(
    el("p", {}, el("b", {}, "decode step ≥ ", value("time_s", s.time_s, seconds(s.time_s))),
       `: batch ${a.batch.toLocaleString("en-US")} at ${a.context.toLocaleString("en-US")} tokens of context on `,
       `${chips} (KV in ${values["--kv-dtype"]}). Memory time ${seconds(s.latency_bound_s)} (weights + KV read once), `,
       `compute time ${seconds(s.compute_s)}: `, el("b", {}, `${binds} binds`),
       `; the weight matmuls are ${s.bound}-bound. Intensity ${fmt(s.intensity)} FLOPs/byte.`),
    el("p", {}, el("b", {}, value("tokens_per_s", a.tokens_per_s, Math.round(a.tokens_per_s).toLocaleString("en-US")),
                   " tokens/s"), ` (${fmt(a.tokens_per_s_per_chip)} per chip). Critical batch `,
       value("critical_batch", a.critical_batch, fmt(a.critical_batch)), "; KV cache ",
       value("kv_bytes_per_token", a.kv_bytes_per_token, a.kv_bytes_per_token.toLocaleString("en-US")),
       " bytes per token: ", value("max_sequences", a.max_sequences, a.max_sequences.toLocaleString("en-US")),
       ` sequences of ${a.context.toLocaleString("en-US")} tokens fit beside the weights`,
       a.fits ? "." : el("b", {}, " (this batch does NOT fit)."),
    ),
    el("p", {}, `prefill of one ${a.context.toLocaleString("en-US")}-token prompt: `,
       value("prefill_s", a.prefill_s, seconds(a.prefill_s)), ` at peak, ${Math.round(prefillRate).toLocaleString("en-US")}`,
       ` tokens/s: ${fmt(prefillRate / a.tokens_per_s)}× this decode rate.`));
}
