"""The rewrite: plan each pointwise Conv and constant-weight Gemm, apply the plans, clean up (pure graph
work on onnx-ir).

May import: ``report``, ``errors``, ``_graphs`` and onnx-ir; never disk, onnxruntime or another stage.
"""
