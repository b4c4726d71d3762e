// window.lab: the course's cost models in the page, as `python -m lab calc` computes them.
//
//   await lab.calc(["memory", "--model", "llama3-8b", "--tp", "2"])   // the text `python -m lab calc ... --json` prints
//   await lab.ready                                                   // resolves once the runtime has started
//
// calc() rejects with an Error whose message is the CLI's one error line (what it prints to stderr). The runtime
// (Pyodide and lab.calc, lab-worker.js) starts on first use, in a Web Worker: a page that never asks for a number never
// downloads its 12 MB. A classic script, not a module: a page opened from file:// may not load modules, and must still
// say why the calculators are not live (live.js) without an error in the console.
(function () {
  "use strict";
  const STATIC = new URL(".", document.currentScript.src);
  const HOW_TO_OPEN = "The live calculators need the site served over http: run `make site-serve` "
    + "(or `python -m lab site --serve`), then open the URL it prints.";
  const pending = new Map();  // id -> {resolve, reject}
  let worker = null;
  let started = null;
  let nextId = 0;

  function start() {
    if (started) return started;
    started = new Promise((resolve, reject) => {
      if (location.protocol === "file:") {  // Chromium refuses a worker (and fetch, and wasm) from file://
        reject(new Error(HOW_TO_OPEN));
        return;
      }
      try {
        worker = new Worker(new URL("lab-worker.js", STATIC), {type: "module"});
      } catch (error) {
        reject(new Error(`${HOW_TO_OPEN} (${error.message})`));
        return;
      }
      worker.onerror = (event) => {  // the worker's script could not load or threw at top level
        event.preventDefault();
        reject(new Error(`${HOW_TO_OPEN} (${event.message || "the worker did not start"})`));
      };
      worker.onmessage = ({data}) => {
        if ("ready" in data) {
          if (data.ready) resolve();
          else reject(new Error(`the live calculators' runtime did not start: ${data.error}`));
          return;
        }
        const call = pending.get(data.id);
        pending.delete(data.id);
        if (data.code === 0) call.resolve(data.stdout);
        else call.reject(new Error(data.stderr.trim() || `python -m lab calc exited with status ${data.code}`));
      };
    });
    started.catch(() => {});  // a page that never awaits it must not log an unhandled rejection
    return started;
  }

  async function calc(argv) {
    if (!Array.isArray(argv)) throw new TypeError(`lab.calc(argv): argv must be an array of strings, got ${argv}`);
    const args = argv.map(String);
    if (!args.includes("--json")) args.push("--json");
    await start();
    return new Promise((resolve, reject) => {
      const id = nextId++;
      pending.set(id, {resolve, reject});
      worker.postMessage({id, argv: args});
    });
  }

  window.lab = Object.defineProperty({calc}, "ready", {get: start, enumerable: true});
}());
