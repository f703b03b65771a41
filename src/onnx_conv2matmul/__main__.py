from onnx_conv2matmul._entry import run

run()
