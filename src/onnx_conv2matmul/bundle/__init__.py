"""Bundles that speech runtimes load: a release folder quantized and laid out for onnx-asr or sherpa-onnx.

May import quantize, verify, rewrite, files, errors and report (today's modules: pipeline, _io, _output, ...).
"""
