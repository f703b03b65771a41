from onnx_conv2matmul.cli.entry import run

run()
