"""Interactive front-ends (ipywidgets) for the course's notebooks.

Widgets are thin: they read a control, call a `lab` function that does the real work (a cost model in
`lab.calc`, a real multi-rank job through `lab.distributed`) and render the answer. Nothing outside this
package imports it, and importing it does not import torch, so calculator widgets stay instant.
The calculators share what every one of them does (controls, a chart, a summary, a one-line error) in
`lab.widgets.base`.
"""

from lab.widgets.welcome import HelloRanks, hello_rank, hello_ranks

__all__ = ["HelloRanks", "hello_rank", "hello_ranks"]
