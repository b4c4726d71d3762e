"""Interactive front-ends (ipywidgets) for the course's notebooks.

Widgets are thin: they read a control, call a `lab` function that does the real work (a cost model in
`lab.calc`, a real multi-rank job through `lab.dist`) and render the answer. Nothing outside this
package imports it, and importing it does not import torch, so calculator widgets stay instant.
"""

from lab.widgets.welcome import HelloRanks, hello_rank, hello_ranks

__all__ = ["HelloRanks", "hello_rank", "hello_ranks"]
