from onnx_conv2matmul.cli import main

main()
