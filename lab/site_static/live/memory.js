// Chapter 01's memory calculator, live: what the fullest GPU holds while training, for any layout you pick.
// The controls and the bar are lab/widgets/memory.py's; the numbers are `python -m lab calc memory --json`.

import {GiB, axes, chart, el, fmt, legend, live, scale, svg, value} from "./ui.js";

const MODELS = ["tiny", "tiny-moe", "smollm-135m", "llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b",
                "mixtral-8x7b", "deepseek-v3"];
const POWERS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];
// the widget's colours; the loss row (the logits' fp32 copy and its gradient) is drawn too, so the bar ends at total
const PARTS = [["params", "#2e7d32"], ["grads", "#1565c0"], ["optimizer", "#f9a825"], ["activations", "#c62828"],
               ["loss", "#6d4c41"]];

const SPECS = [
  {name: "--model", label: "model", kind: "select", options: MODELS, value: "llama3-8b"},
  {name: "--seq", label: "seq", kind: "select", options: Array.from({length: 11}, (_, k) => 2 ** (k + 7)),
   value: 4096},
  {name: "--mbs", label: "micro-batch", kind: "number", min: 1, max: 32, step: 1, value: 1},
  {name: "--precision", label: "precision", kind: "select", options: ["fp32", "mixed", "bf16", "mixed-fp32-grads"],
   value: "mixed"},
  {name: "--fp32-grad-accum", label: "fp32 grad accumulation", kind: "checkbox", value: false},
  {name: "--recompute", label: "recompute", kind: "select", options: ["none", "selective", "full"], value: "none"},
  {name: "--flash", label: "flash attention", kind: "checkbox", value: false},
  {name: "--activation-model", label: "activations", kind: "select", options: ["korthikanti", "exact"],
   value: "korthikanti"},
  {name: "--dp", label: "dp", kind: "select", options: POWERS, value: 1},
  {name: "--zero", label: "ZeRO", kind: "select", options: [0, 1, 2, 3], value: 0},
  {name: "--tp", label: "tp", kind: "select", options: POWERS.slice(0, 8), value: 1},
  {name: "--sp", label: "sequence parallel", kind: "checkbox", value: false},
  {name: "--pp", label: "pp", kind: "select", options: POWERS.slice(0, 8), value: 1},
  {name: "--pp-schedule", label: "schedule", kind: "select", options: ["afab", "1f1b", "interleaved", "zb-h1"],
   value: "1f1b"},
  {name: "--cp", label: "cp", kind: "select", options: POWERS.slice(0, 8), value: 1},
  {name: "--ep", label: "ep", kind: "select", options: POWERS.slice(0, 9), value: 1},
  {name: "--hardware", label: "GPU", kind: "select", options: ["h100", "h200", "a100", "b200", "tpu-v5e", "tpu-v5p"],
   value: "h100"},
];

export async function mount(root, calc) {
  await live(root, calc, {
    specs: SPECS,
    command: "memory",
    draw,
  });
}

function draw(answer, values, view) {
  const perGpu = answer.per_gpu_bytes;
  const capacity = answer.hardware_memory_bytes;
  const c = chart(640, 96, {top: 12, bottom: 40, left: 16});
  const x = scale(0, Math.max(perGpu.total, capacity) * 1.05 / GiB, c.box.left, c.box.right);
  axes(c, x, null, {xlabel: "GiB per GPU"});
  let left = 0;
  for (const [part, colour] of PARTS) {
    const width = perGpu[part] / GiB;
    c.svg.append(svg("rect", {x: x(left), y: 22, width: x(left + width) - x(left), height: 28, fill: colour,
                              "data-part": part, "data-value": JSON.stringify(perGpu[part])},
                     svg("title", {}, `${part}: ${fmt(width)} GiB`)));
    left += width;
  }
  c.svg.append(svg("line", {x1: x(capacity / GiB), x2: x(capacity / GiB), y1: 14, y2: 58, class: "live-limit",
                            "data-part": "capacity", "data-value": JSON.stringify(capacity)}));
  view.plot.replaceChildren(c.svg, legend([
    ...PARTS.map(([part, colour]) => [`${part} ${fmt(perGpu[part] / GiB)}`, colour]),
    [`${values["--hardware"]} ${fmt(capacity / GiB)} GiB`, "black", true]]));
  const stage = Number(values["--pp"]) > 1 ? ` (pipeline stage ${answer.stage}, the fullest)` : "";
  view.summary.replaceChildren(el("p", {},
    el("b", {}, value("total", perGpu.total, `${fmt(perGpu.total / GiB)} GiB`)),
    ` (${fmt(perGpu.total / 1e9)} GB) per GPU${stage} at seq ${Number(values["--seq"]).toLocaleString("en-US")} × `,
    `micro-batch ${values["--mbs"]}: `, value("fits", answer.fits, answer.fits ? "fits" : "does NOT fit"),
    ` in ${fmt(capacity / GiB)} GiB. Model: `, value("num_params", answer.num_params, count(answer.num_params)),
    " parameters."));
}

function count(n) {
  return n >= 1e9 ? `${fmt(n / 1e9)} B` : n >= 1e6 ? `${fmt(n / 1e6)} M` : n.toLocaleString("en-US");
}
