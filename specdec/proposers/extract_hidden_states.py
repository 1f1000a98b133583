"""ExtractHiddenStatesProposer (method ``extract_hidden_states``, K = 1).

It runs no draft model (so it builds on ``PaddedProposer``, not the draft step): it
captures the target's aux-layer hidden states for every prompt
token and, once a request's prefill is complete, writes ``<request_id>.safetensors`` with
``token_ids [T]`` int64 and ``hidden_states [T, num_layers, H]`` to ``output_dir``. Its
draft is the token just sampled (verification keeps the output lossless).

Chunked prefill: each step scatters its tokens' states into a per-request device buffer at
their positions (no host sync); the file is written once, after the last chunk, to a
temporary name and then renamed, so no partial file is ever visible.
"""

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.graphs import Backend
from specdec.proposers.base import PaddedProposer
from specdec.padding import StepPlan, StepSizes
from specdec.proposers.inputs import DraftInputs


def holds_hidden_states(path: Path) -> bool:
    """Whether the folder already holds ``*.safetensors`` files (another run's)."""
    return path.is_dir() and any(path.glob("*.safetensors"))


def check_output_dir(config) -> Path:
    """``draft_model_config.output_dir``: required, and not a folder that already holds
    ``*.safetensors`` files (another run's files would be overwritten) unless
    ``draft_model_config.overwrite_output_dir`` is True."""
    dmc = config.draft_model_config
    out = dmc.get("output_dir")
    if not out or not isinstance(out, (str, os.PathLike)):
        raise ValueError(f"draft_model_config.output_dir={out!r}: method='extract_hidden_states' "
                         "needs the folder the files are written to (a str path)")
    overwrite = dmc.get("overwrite_output_dir", False)
    if not isinstance(overwrite, bool):
        raise TypeError(f"draft_model_config.overwrite_output_dir={overwrite!r}: must be a bool")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"draft_model_config.output_dir={str(path)!r} is not a folder")
    if not overwrite and holds_hidden_states(path):
        raise ValueError(f"draft_model_config.output_dir={str(path)!r} already holds "
                         "*.safetensors files; pick an empty folder or set "
                         "draft_model_config.overwrite_output_dir=True")
    return path


class ExtractHiddenStatesProposer(PaddedProposer):
    reads_prompt_states = True  # so no prefix caching: a hit computes no prompt state

    @classmethod
    def head_folder(cls, spec, model_dir: Path | None) -> None:
        """No draft model; the output folder is checked instead (before anything is built)."""
        check_output_dir(spec)

    @classmethod
    def build(cls, spec, target, head, sizes: StepSizes, *, block_size: int,
              num_kv_blocks: int, dtype: torch.dtype, device: torch.device,
              backend: Backend) -> "ExtractHiddenStatesProposer":
        return cls(spec, output_dir=Path(spec.draft_model_config["output_dir"]),
                   num_aux_layers=len(spec.aux_layer_ids(target.config.num_hidden_layers)),
                   hidden_size=target.config.hidden_size, dtype=dtype,
                   max_num_seqs=sizes.max_num_reqs, block_size=block_size,
                   max_model_len=sizes.max_model_len, vocab_size=target.config.vocab_size,
                   device=device)

    def __init__(self, config, *, output_dir: Path, num_aux_layers: int, hidden_size: int,
                 dtype: torch.dtype, **sizes):
        """output_dir: ``check_output_dir(config)``'s folder (created here)."""
        super().__init__(config, **sizes)
        self.output_dir = output_dir
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # [rows + 1 (trash), max_model_len, A, H]: the states of every prompt position
        self.states = torch.zeros(self.max_num_seqs + 1, self.max_model_len, num_aux_layers,
                                  hidden_size, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def propose(self, x: DraftInputs) -> torch.Tensor:
        """Stash this step's aux states; the draft [Bp, 1] int32 is the sampled next token."""
        next_ids, *_ = self.prepare_padded(
            x.sampled_token_ids, x.discard_mask, x.cu_num_draft_tokens, x.attn.query_start_loc,
            x.token_table, x.rows, x.attn.seq_lens)
        n = x.input_ids.shape[0]
        req = x.attn.request_of_token(n)
        # padding tokens (slot -1) go to the trash row; a padding request's row is the token
        # table's trash row, never a real one
        rows = torch.where(x.attn.slot_mapping < 0, self.max_num_seqs, x.rows[req])
        cols = x.positions.clamp(max=self.max_model_len - 1)
        self.states[rows, cols] = x.aux_hidden_states.to(self.states.dtype)
        return next_ids[:, None]

    def dummy_run(self, plan: StepPlan) -> None:
        """No draft model, so no forward and no collective to match."""

    def on_prefill_done(self, request) -> None:
        """Write the request's file (host side, after the step): write, then rename."""
        t = request.num_prompt_tokens
        tensors = {
            "token_ids": torch.tensor(request.token_ids[:t], dtype=torch.int64),
            "hidden_states": self.states[request.row, :t].cpu().contiguous(),
        }
        final = self.output_dir / f"{request.request_id}.safetensors"
        tmp = final.with_suffix(".safetensors.tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, final)
