"""ResNets and reversible networks (RevNets) split into PETRA stages.

A model is a list of :class:`~petra_jax.engine.stage.Stage` objects, one residual
block per stage, as in the paper (Sec. 4, "Model adaptations"): 10 stages for
the 18-layer models (stem, 8 blocks, head), 18 for the 34- and 50-layer ones
(stem, 16 blocks, head). Built by :func:`build_model` from :data:`MODEL_SPECS`.

Modules, one concept each:

* :mod:`~petra_jax.models.layers`: conv + BN with PyTorch's initialisation,
  the stem and the head (both families).
* :mod:`~petra_jax.models.revnet`: RevNet blocks on two streams (``revnet18/34/50``,
  their invertible-downsampling ``_inv`` variants, ``revnet_fixed``).
* :mod:`~petra_jax.models.invertible`: i-RevNet's invertible downsampling.
* :mod:`~petra_jax.models.vit`: reversible vision transformers
  (``revvit_tiny/small``) and their plain twins (``vit_tiny/small``).
* :mod:`~petra_jax.models.resnet`: torchvision's ResNets (``resnet18/34/50``),
  the backprop baselines.
* :mod:`~petra_jax.models.specs`: the registry (:data:`MODEL_SPECS`,
  :data:`MODEL_FAMILY`) and :func:`build_model`.
* :mod:`~petra_jax.models.grouping`: consecutive blocks grouped into stages
  (:func:`group_stages`, :func:`balanced_stage_sizes`).
* :mod:`~petra_jax.models.summary`: per-stage shapes and parameter counts, and
  the CLI ``python -m petra_jax.models NAME --dataset=cifar10 [--width=W]
  [--depth=N] [--json]``. Not imported here: it reads the data registry.

Whether a model has reversible blocks: :func:`petra_jax.engine.stage.has_reversible`.
"""

from petra_jax.models import invertible
from petra_jax.models.grouping import balanced_stage_sizes, block_flops, group_stages
from petra_jax.models.layers import Head, Stem
from petra_jax.models.resnet import ResNetBasicBlock, ResNetBottleneck
from petra_jax.models.revnet import (BasicDownsample, BasicResidual, BottleneckDownsample,
                                     BottleneckResidual)
from petra_jax.models.specs import (MODEL_FAMILY, MODEL_SPECS, ModelSpec, build_model,
                                    is_reversible, is_user_model, source_fingerprint)
from petra_jax.models.vit import TOKENIZERS

__all__ = [
    "BasicDownsample", "BasicResidual", "BottleneckDownsample", "BottleneckResidual",
    "Head", "MODEL_FAMILY", "MODEL_SPECS", "ModelSpec", "ResNetBasicBlock",
    "ResNetBottleneck", "Stem", "TOKENIZERS", "balanced_stage_sizes", "block_flops", "build_model",
    "group_stages", "invertible", "is_reversible", "is_user_model", "source_fingerprint",
]
