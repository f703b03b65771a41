"""Quantization: per-node MatMulNBits, other weights as int8, the ``--auto`` search and the quantize
workflow.

May import: ``rewrite``, ``verify``, ``files``, ``report``, ``errors``, ``_graphs``; never cli.
"""
