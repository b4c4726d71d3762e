"""Mixed precision and FP8 for chapter 10.

`loss_scale` re-implements fp16's dynamic loss scaling (checked step for step against torch's GradScaler);
`master` keeps fp32 master weights for a model computing in bf16/fp16 (FSDP2's `param_dtype`/`reduce_dtype`);
`fp8` holds the FP8 scaling recipes — one API with two knobs, the granularity of a scale (tensor, row, 1×128
tile, 128×128 block) and its timing (current or delayed) —, the block-scaled GEMM, and the device-side flags that
record a non-finite amax; `fp8_linear` the linear layer whose three GEMMs run in FP8; `microscaling` the
block-scaled formats after FP8 (MXFP8, MXFP6, MXFP4 with E8M0 scales per 32 values, NVFP4 with E4M3 scales per 16
and a tensor scale); `fp8_monitor` the checks that catch a delayed scale overflowed by an outlier. The number
formats themselves are torch-free, in `lab.calc.formats`.
"""
