"""Where a method's head folder is: ``speculative_config.model``, the target folder (MTP
layers saved with the target) or the target folder's sibling named after the method."""

from pathlib import Path

from specdec.config import SpeculativeConfig
from specdec.models.heads.registry import MTP_TARGETS, holds_mtp_layers, target_architecture


def find_head_dir(spec: SpeculativeConfig, model_dir: Path | None) -> Path:
    """``speculative_config.model``; else for ``mtp`` the target folder itself when it holds
    its MTP layer (``holds_mtp_layers``), as vLLM takes the target as the MTP model;
    else ``<target folder>/../<method>`` (the embedded default model's sibling heads)."""
    if spec.model is not None:
        path = Path(spec.model)
    elif model_dir is not None:
        if spec.method == "mtp" and holds_mtp_layers(model_dir):
            return Path(model_dir)
        path = Path(model_dir).parent / spec.method  # e.g. assets/default/{target,eagle3}
    else:
        raise ValueError(f"speculative_config.model is required for method={spec.method!r}")
    if not (path / "config.json").exists():
        where = ""
        if spec.method == "mtp" and spec.model is None:
            arch = target_architecture(model_dir)
            archs = f"{', '.join(MTP_TARGETS[:-1])} or {MTP_TARGETS[-1]}"
            where = (f"; the target folder {str(model_dir)!r} is a {arch} checkpoint, but its "
                     "files hold no MTP layer's tensors (only the target's shards were "
                     "saved or downloaded?)" if arch in MTP_TARGETS else
                     f"; the target folder {str(model_dir)!r} is not a {archs} checkpoint "
                     "holding its MTP layer")
        raise ValueError(f"speculative_config.model={str(path)!r} has no config.json "
                         f"(the folder of a {spec.method!r} head is needed{where})")
    return path
