"""Bundles that speech runtimes load: a release folder quantized and laid out for onnx-asr or sherpa-onnx.

May import: ``quantize``, ``rewrite``, ``verify``, ``files``, ``report``, ``errors``, ``_graphs``; never cli.
"""
