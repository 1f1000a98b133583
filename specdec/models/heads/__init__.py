"""Draft heads (MTP, EAGLE-1, EAGLE-3) in the checkpoint layouts vLLM's loaders accept: the
interface (``base``), one module per family, the loader by architecture (``registry``) and
fresh heads for training (``training``)."""

from specdec.models.heads.base import DraftHead, SharedWeights
from specdec.models.heads.eagle import Eagle3Head, EagleHead
from specdec.models.heads.mimo_mtp import MtpHead
from specdec.models.heads.registry import load_head
from specdec.models.heads.training import build_head, head_config

__all__ = ["DraftHead", "Eagle3Head", "EagleHead", "MtpHead", "SharedWeights", "build_head",
           "head_config", "load_head"]
