"""Speed: time models side by side on this CPU; choose the MatMulNBits kernel settings that run fastest.

May import onnxruntime, numpy, onnx, errors, report and verify (input synthesis, comparison); never cli.
"""
