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
