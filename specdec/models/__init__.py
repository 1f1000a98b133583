"""Target models by architecture (``registry``), their layers (``layers/``), draft heads
(``heads``) and the checkpoint loader (``checkpoint``)."""

from specdec.models.registry import ARCHITECTURES, load_model

__all__ = ["ARCHITECTURES", "load_model"]
