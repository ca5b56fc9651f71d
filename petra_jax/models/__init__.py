"""The model zoo as PETRA stages, one residual block each (paper Sec. 4): :func:`build_model`.

``python -m petra_jax.models NAME --dataset=D [--width=W] [--depth=N] [--json]`` prints them.
"""

from petra_jax.models import invertible
from petra_jax.models.layers import Head, Stem
from petra_jax.models.resnet import ResNetBasicBlock, ResNetBottleneck
from petra_jax.models.revnet import (BasicDownsample, BasicResidual, BottleneckDownsample,
                                     BottleneckResidual)
from petra_jax.models.specs import (MODEL_SPECS, ModelSpec, build_model,
                                    is_reversible, is_user_model, source_fingerprint)
from petra_jax.models.vit import TOKENIZERS

__all__ = [
    "BasicDownsample", "BasicResidual", "BottleneckDownsample", "BottleneckResidual",
    "Head", "MODEL_SPECS", "ModelSpec", "ResNetBasicBlock",
    "ResNetBottleneck", "Stem", "TOKENIZERS", "build_model",
    "invertible", "is_reversible", "is_user_model", "source_fingerprint",
]
