"""The runner's persistent step inputs: fixed device addresses, filled in place every step.

Every field is a view into one flat tensor per dtype, on the device and (pinned on CUDA) on
the host; ``fill`` writes the host twin with numpy and copies each flat tensor once, so a step
costs three host->device copies however many fields it has. The host twins are views of one
byte buffer (``wire``). ``view(num_tokens, num_reqs)``
gives the leading ``[Np]`` / ``[Bp]`` slices the padded step runs on; a captured graph of
bucket Bp reads exactly those addresses.
"""

from typing import NamedTuple

import numpy as np
import torch

from specdec.engine.sequence import MIN_TOKENS_STOP_IDS


class StepInputs(NamedTuple):
    """Views of the buffers for one step: N = num_tokens_padded, B = num_reqs_padded. The
    target step's inputs (``ModelRunner.target_step``), passed positionally through its
    StepGraph."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64, -1 = don't write (padding tokens)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [B, K+1] int64, token row of each verified position
    draft_token_ids: torch.Tensor  # [B, K] int32 drafts being verified (0-padded)
    num_draft_tokens: torch.Tensor  # [B] int32
    cu_num_draft_tokens: torch.Tensor  # [B] int32 inclusive cumsum
    discard_mask: torch.Tensor  # [B] bool: partial prefills and padding rows
    rows: torch.Tensor  # [B] int64 token-table rows (padding rows: the trash row)
    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    rng_key: torch.Tensor  # [B] int64 random key of each request (counter_rng.request_key)
    # the processed variant's (``penalties``, ``rejection_sampler.target_probs``); the
    # neutral values elsewhere and in padding rows
    top_k: torch.Tensor  # [B] int32, 0 = every token
    min_p: torch.Tensor  # [B] float32, 0 = off
    repetition_penalty: torch.Tensor  # [B] float32, 1 = off
    frequency_penalty: torch.Tensor  # [B] float32, 0 = off
    presence_penalty: torch.Tensor  # [B] float32, 0 = off
    num_prompt: torch.Tensor  # [B] int64 prompt tokens (token-table columns before: prompt)
    min_len: torch.Tensor  # [B] int64 num_prompt + min_tokens: no stop id at a position below
    stop_ids: torch.Tensor  # [B, S] int32 the ids min_tokens holds back, -1 = none
    # a draft tree's (``TreeMask``; unused by chain steps): per token its node, depth and
    # ancestor bitmask (a token outside a tree: 0, 0, 1), per request each node's parent
    tree_node: torch.Tensor  # [N] int64
    tree_depth: torch.Tensor  # [N] int64
    tree_ancestors: torch.Tensor  # [N] int64
    tree_parents: torch.Tensor  # [B, K+1] int64, -1 for the root


def _layout(max_tokens: int, max_reqs: int, k: int, max_blocks: int):
    """field -> (dtype, shape at the largest step)."""
    n, b = max_tokens, max_reqs
    return {
        "input_ids": (torch.int64, (n,)), "positions": (torch.int64, (n,)),
        "slot_mapping": (torch.int64, (n,)), "logits_indices": (torch.int64, (b, k + 1)),
        "rows": (torch.int64, (b,)), "rng_key": (torch.int64, (b,)),
        "query_start_loc": (torch.int32, (b + 1,)), "seq_lens": (torch.int32, (b,)),
        "block_table": (torch.int32, (b, max_blocks)), "draft_token_ids": (torch.int32, (b, k)),
        "num_draft_tokens": (torch.int32, (b,)), "cu_num_draft_tokens": (torch.int32, (b,)),
        "discard_mask": (torch.bool, (b,)),
        "temperature": (torch.float32, (b,)), "top_p": (torch.float32, (b,)),
        "top_k": (torch.int32, (b,)), "min_p": (torch.float32, (b,)),
        "repetition_penalty": (torch.float32, (b,)), "frequency_penalty": (torch.float32, (b,)),
        "presence_penalty": (torch.float32, (b,)), "num_prompt": (torch.int64, (b,)),
        "min_len": (torch.int64, (b,)), "stop_ids": (torch.int32, (b, MIN_TOKENS_STOP_IDS)),
        "tree_node": (torch.int64, (n,)), "tree_depth": (torch.int64, (n,)),
        "tree_ancestors": (torch.int64, (n,)), "tree_parents": (torch.int64, (b, k + 1)),
    }


class StepBuffers:
    """``header``: int64 words placed before the fields in ``wire``, the one host byte buffer
    that holds every flat host tensor (tensor parallelism broadcasts it whole, once a step)."""

    def __init__(self, max_tokens: int, max_reqs: int, k: int, max_blocks: int,
                 device: torch.device, header: int = 0):
        layout = _layout(max_tokens, max_reqs, k, max_blocks)
        sizes: dict[torch.dtype, int] = {}
        offsets = {}
        for name, (dtype, shape) in layout.items():
            offsets[name] = sizes.get(dtype, 0)
            sizes[dtype] = offsets[name] + int(np.prod(shape))
        pin = device.type == "cuda"
        starts, nbytes = {}, 8 * header
        for d, s in sizes.items():  # each flat tensor 8-byte aligned in the wire
            starts[d] = nbytes
            nbytes += -(-s * d.itemsize // 8) * 8
        self.wire = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.header = self.wire[:8 * header].view(torch.int64)
        self.flat_host = {d: self.wire[starts[d]:starts[d] + s * d.itemsize].view(d)
                          for d, s in sizes.items()}
        self.flat_device = {d: torch.zeros(s, dtype=d, device=device) for d, s in sizes.items()}
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, (dtype, shape) in layout.items():
            o, size = offsets[name], int(np.prod(shape))
            self.host[name] = self.flat_host[dtype][o:o + size].view(shape).numpy()
            self.device[name] = self.flat_device[dtype][o:o + size].view(shape)
        self.max_tokens, self.max_reqs = max_tokens, max_reqs

    def copy_to_device(self) -> None:
        for dtype, host in self.flat_host.items():
            self.flat_device[dtype].copy_(host, non_blocking=True)

    def view(self, num_tokens: int, num_reqs: int) -> StepInputs:
        d, n, b = self.device, num_tokens, num_reqs
        per_token = ("input_ids", "positions", "slot_mapping", "tree_node", "tree_depth",
                     "tree_ancestors")
        fields = {name: t[:n] if name in per_token else t[:b] for name, t in d.items()}
        fields["query_start_loc"] = d["query_start_loc"][:b + 1]
        return StepInputs(**fields)
