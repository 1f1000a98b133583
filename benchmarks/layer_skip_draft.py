"""A draft model for method ``draft_model`` cut from a Llama-layout target: its first N layers,
final norm and lm_head (LayerSkip's early exit, untrained), written as a checkpoint folder with
the target's tokenizer. The embedded model ships no separate draft LM; this one lets the
benchmarks run ``draft_model`` (chains and trees) on it. ``--fit-temperature`` also fits its
``tree_score_temperature`` (``specdec.train.tree_temperature``), the score temperature of its
dynamic trees.

    python -m benchmarks.layer_skip_draft OUT [--layers 2] [--target DIR] [--fit-temperature]
"""

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from specdec.engine.llm import DEFAULT_MODEL
from specdec.train.tree_temperature import fit_draft_model


def cut(target: Path, out: Path, layers: int) -> Path:
    """Write ``target``'s first ``layers`` layers (with its embedding, final norm, lm_head and
    tokenizer) to ``out`` -> ``out``."""
    config = json.loads((target / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"--layers={layers}: allowed 1..{config['num_hidden_layers'] - 1} "
                         f"(the target has {config['num_hidden_layers']})")
    weights = load_file(str(target / "model.safetensors"))
    keep = {k: v for k, v in weights.items()
            if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < layers}
    out.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out / "model.safetensors"))
    config["num_hidden_layers"] = layers
    config.pop("num_nextn_predict_layers", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(target / "tokenizer.json", out / "tokenizer.json")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--target", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--fit-temperature", action="store_true",
                    help="fit its tree_score_temperature into its config.json")
    args = ap.parse_args()
    print(cut(args.target, args.out, args.layers))
    if args.fit_temperature:
        print(fit_draft_model(args.target, args.out)["draft_model"])


if __name__ == "__main__":
    main()
