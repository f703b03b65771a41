"""The check: synthesise or load inputs, run original and candidate in onnxruntime, compare the outputs.

May import: ``report``, ``errors``, ``_graphs``, onnxruntime and numpy; never quantize, bundle or cli.
"""
