// The course's cost models (lab.calc) in a Web Worker, so that the page stays responsive while Python runs.
//
// Started by lab-calc.js as a module worker. It loads Pyodide (CPython compiled to WebAssembly) from the site's own
// static/pyodide/ folder, unpacks static/lab-calc.zip (lab/calc/, lab/config.py, lab/layout.py from the checkout that
// built the site: `python -m lab site`) and calls the very main() that `python -m lab calc` runs. No package from
// Pyodide's repository is loaded: lab.calc is pure Python on the standard library, so nothing leaves the site.
//
// Messages: {id, argv} in; {id, code, stdout, stderr} out. The first message out is {ready: true} or
// {ready: false, error}.

import {loadPyodide} from "./pyodide/pyodide.mjs";

// The CLI's main() with stdout/stderr captured; argparse ends with SystemExit, whose code is the exit status.
const RUN = `
import contextlib
import io
import sys

sys.path.insert(0, "/lab-calc")
import lab.calc.cli


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = lab.calc.cli.main(list(argv))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    return [code or 0, out.getvalue(), err.getvalue()]


run
`;

async function start() {
  const pyodide = await loadPyodide({indexURL: new URL("./pyodide/", import.meta.url).href});
  const zip = await fetch(new URL("./lab-calc.zip", import.meta.url));
  if (!zip.ok) throw new Error(`static/lab-calc.zip: HTTP ${zip.status}`);
  pyodide.unpackArchive(await zip.arrayBuffer(), "zip", {extractDir: "/lab-calc"});
  return pyodide.runPython(RUN);
}

const running = start();
running.then(() => postMessage({ready: true}),
             (error) => postMessage({ready: false, error: String(error && error.message || error).split("\n")[0]}));

onmessage = async ({data: {id, argv}}) => {
  try {
    const result = (await running)(argv);
    const [code, stdout, stderr] = result.toJs();
    result.destroy();
    postMessage({id, code, stdout, stderr});
  } catch (error) {  // a Python exception main() did not turn into an error line: its last line, as the CLI's would be
    postMessage({id, code: 1, stdout: "", stderr: String(error && error.message || error).trim().split("\n").pop()});
  }
};
