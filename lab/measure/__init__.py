"""Lesson instruments: what a chapter runs to measure a real step or to show a technique at work.

What belongs here: code a notebook, a benchmark, a test or an exercise check runs to count, time or display what
the implementations do (bytes autograd keeps, a memory or communication timeline, a demonstration of a production
API's options), never code an implementation imports. The implementations live in `lab.model`, `lab.parallel`,
... and the predictions these measurements are checked against in `lab.calc`.

* `memory`: activation, parameter, gradient and optimizer bytes of a `lab.model` step, counted on real tensors
  (checks `lab.calc.memory`);
* `saved`: the bytes autograd saves for backward while any module runs forward;
* `recompute`: small residual blocks to checkpoint and to measure (chapter 01's exercises);
* `memory_timeline`: the profiler's memory timeline of training steps, by category;
* `overlap`: one data-parallel step as a timeline of compute, communication and waiting, on real ranks;
* `fsdp2`: FSDP2's options and HSDP (`fully_shard`) on the course's model, checked against one process.
* `cpu`: the matmul FLOP/s and copy bandwidth this CPU reaches (the rooflines `lab sweep` and `lab serve` use).
* `launch`: what an op costs before it does any work (the launch floor, the Python share), the roofline with that
  floor, a step's profile and a recorded GPU trace's kernels and gaps (chapter 09).
* `kernel_time`: a profile's or a trace's kernel time by category (matmul, attention, elementwise, copy+cast,
  communication): where a GPU step's time went (`make bench-gpu`).

Import the module you need (`from lab.measure.memory import saved_activation_bytes`): this package imports
nothing, so an exercise's sandbox can carry one of its modules alone.
"""
