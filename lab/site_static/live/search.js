// Chapter 08's config explorer, live: the playbook's search for the best training layout ("Finding the Best Training
// Configuration"), run by `python -m lab calc search --json` as you type. The inputs are lab/widgets/search.py's;
// the page shows the ranked table of the top layouts, their modelled tokens/s as bars (with the calibration's spread
// as whiskers), and the families of which no layout fits or runs, with the reason.

import {GiB, axes, chart, el, fmt, live, scale, seconds, svg, value} from "./ui.js";

const MODELS = ["tiny", "tiny-moe", "smollm-135m", "llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b",
                "mixtral-8x7b", "deepseek-v3"];

const SPECS = [
  {name: "--model", label: "model", kind: "select", options: MODELS, value: "llama3-70b"},
  {name: "--gpus", label: "GPUs", kind: "number", min: 1, max: 16384, step: 1, value: 256},
  {name: "--gpus-per-node", label: "GPUs per node", kind: "number", min: 1, max: 72, step: 1, value: 8},
  {name: "--hardware", label: "hardware", kind: "select", options: ["h100", "h200", "a100", "b200"], value: "h100"},
  {name: "--seq", label: "sequence (tokens)", kind: "number", min: 1, step: 1, value: 8192},
  {name: "--gbs-tokens", label: "global batch (tokens)", kind: "text", value: "4M",
   title: "a number (4194304, 4e6) or with K, M, G (2^10, 2^20, 2^30 tokens): 1M, 4M"},
  {name: "--top", label: "top N", kind: "number", min: 1, max: 20, step: 1, value: 10},
];

export async function mount(root, calc) {
  await live(root, calc, {
    specs: SPECS,
    command: "search",
    draw,
  });
}

function draw(r, values, view) {
  const top = r.candidates;
  const batch = `${r.global_batch.toLocaleString("en-US")} sequences × ${r.seq.toLocaleString("en-US")} = `
    + `${r.tokens_per_step.toLocaleString("en-US")} tokens`;
  const rejected = rejectedFamilies(r.rejected_families);
  if (top.length === 0) {
    view.plot.replaceChildren();
    view.summary.replaceChildren(el("p", {}, el("b", {}, `No layout of ${r.model} fits ${r.gpus} ${r.hardware} GPUs`),
                                    ` with a global batch of ${batch}: see why below.`), rejected);
    return;
  }
  const best = top[0];
  view.plot.replaceChildren(bars(top), table(top));
  view.summary.replaceChildren(el("p", {},
    el("b", {}, `Best: ${best.layout}, mbs ${best.mbs} × grad-accum ${best.grad_accum}: `,
       value("tokens_per_s.0", best.tokens_per_s, Math.round(best.tokens_per_s).toLocaleString("en-US")),
       ` tokens/s, MFU ${fmt(best.mfu * 100)} %`),
    " (", value("layouts_kept", r.layouts_kept, r.layouts_kept.toLocaleString("en-US")),
    ` layouts fit; global batch ${batch}; searched in ${fmt(r.elapsed_s)} s). ${r.ties} `,
    `${r.ties === 1 ? "layout ties" : "layouts tie"} with it: their tokens/s ranges (the calibration's spread) `,
    `reach its ${Math.round(best.tokens_per_s_range[0]).toLocaleString("en-US")}.`), rejected);
}

function bars(top) {
  const rowHeight = 20;
  const c = chart(640, rowHeight * top.length + 52, {left: 40, right: 16, top: 8, bottom: 44,
                                                      title: "tokens/s of the top layouts"});
  const most = Math.max(...top.map((t) => t.tokens_per_s_range[1]));
  const x = scale(0, most * 1.05, c.box.left, c.box.right);
  axes(c, x, null, {xlabel: "tokens/s (modelled; whiskers: the calibration's spread)"});
  top.forEach((t, i) => {
    const y = c.box.top + i * rowHeight;
    const [low, high] = t.tokens_per_s_range;
    c.svg.append(
      svg("rect", {x: x(0), y: y + 3, width: x(t.tokens_per_s) - x(0), height: rowHeight - 6,
                   fill: i === 0 ? "#2e7d32" : "#66bb6a", "data-key": `bar.${i}`,
                   "data-value": JSON.stringify(t.tokens_per_s)}, svg("title", {}, `#${i + 1} ${t.layout}`)),
      svg("line", {x1: x(low), x2: x(high), y1: y + rowHeight / 2, y2: y + rowHeight / 2, stroke: "#333"}),
      svg("text", {x: c.box.left - 4, y: y + rowHeight / 2 + 4, "text-anchor": "end"}, `#${i + 1}`));
  });
  return c.svg;
}

function table(top) {
  const head = ["#", "layout", "mbs", "grad-accum", "memory (GiB)", "MFU", "tokens/s",
                "step (compute / comms / bubble)"];
  return el("table", {class: "live-table"},
    el("thead", {}, el("tr", {}, head.map((h) => el("th", {scope: "col"}, h)))),
    el("tbody", {}, top.map((t, i) => el("tr", {"data-layout": t.layout},
      el("td", {}, String(i + 1)), el("td", {}, t.layout), el("td", {}, String(t.mbs)),
      el("td", {}, String(t.grad_accum)),
      el("td", {}, value(`memory_bytes.${i}`, t.memory_bytes, fmt(t.memory_bytes / GiB))),
      el("td", {}, `${fmt(t.mfu * 100)} %`),
      el("td", {}, value(`tokens_per_s.${i}`, t.tokens_per_s, Math.round(t.tokens_per_s).toLocaleString("en-US"))),
      el("td", {}, `${seconds(t.time_s.total)} (${seconds(t.time_s.compute)} / ${seconds(t.time_s.comms)} / `
                   + `${seconds(t.time_s.bubble)})`)))));
}

function rejectedFamilies(families) {
  const names = Object.keys(families);
  if (names.length === 0) return el("p", {}, "Every family enumerated has a layout that fits.");
  names.sort((a, b) => families[b].count - families[a].count || a.localeCompare(b));
  return el("details", {class: "live-rejected"},
    el("summary", {}, `${names.length} ${names.length === 1 ? "family" : "families"} with no layout that fits or runs`),
    el("ul", {}, names.map((name) => el("li", {}, el("b", {}, name),
      `: ${families[name].reason} (${families[name].count} layouts): ${families[name].message}`))));
}
