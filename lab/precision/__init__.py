"""Mixed precision and FP8 for chapter 10.

`loss_scale` re-implements fp16's dynamic loss scaling (checked step for step against torch's GradScaler);
`master` keeps fp32 master weights for a model computing in bf16/fp16 (FSDP2's `param_dtype`/`reduce_dtype`);
`fp8` holds the FP8 scaling recipes — one API with two knobs, the granularity of a scale (tensor, row, 1×128
tile, 128×128 block) and its timing (current or delayed) — and the block-scaled GEMM; `fp8_linear` the linear
layer whose three GEMMs run in FP8. The number formats themselves are torch-free, in `lab.calc.formats`.
"""
