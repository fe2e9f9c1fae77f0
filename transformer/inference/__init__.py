"""Use a trained model from any program, without Hydra or Lightning (docs/inference.md):

    from transformer.inference import Translator
    translator = Translator.from_checkpoint("runs/.../checkpoints/last.ckpt")
    translator.translate(["ein Hund läuft"], beam_size=4)[0].text

`Translator` (translation checkpoints: trained, averaged, ensembled, LoRA, imported OPUS-MT), `Classifier`
(classification checkpoints: trained or imported BERT), `load` (either, by the checkpoint's task).
"""

from transformer.inference.classifier import Classifier, load
from transformer.inference.ctranslate2 import CTranslate2Translator
from transformer.inference.outputs import Hypothesis, InferenceError, Prediction, Segment, Translation
from transformer.inference.translator import DecodedBatch, Translator
from transformer.search.decoding import DecodingSettings

__all__ = [
    "CTranslate2Translator",
    "Classifier",
    "DecodedBatch",
    "DecodingSettings",
    "Hypothesis",
    "InferenceError",
    "Prediction",
    "Segment",
    "Translation",
    "Translator",
    "load",
]
