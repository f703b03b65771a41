from onnx_conv2matmul.cli import run

run()
