"""Train the embedded default: tokenizer, tiny Llama target, then MTP / EAGLE / EAGLE-3 heads.

``python -m specdec.train.train_default --out specdec/assets/default`` (CPU, deterministic seed).

1. byte-level BPE on the training half of the stdlib ``.py`` files (``data.py`` split rule);
2. target: next-token cross-entropy on random windows;
3. heads, on the FROZEN target as saved (fp16 weights, fp32 compute): self-distillation
   (soft cross-entropy to the target's next-token distribution), unrolled ``--unroll`` steps with
   each step fed its own ``next_hidden`` (attention per ``UnrolledKV``); MTP and EAGLE also
   regress ``next_hidden`` on the target hidden of the same position. Half of each batch is
   real text, half a train prompt followed by the target's greedy continuation;
4. offline acceptance estimate on held-out prompts (``acceptance.py``) -> ``TRAINING.md``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from specdec.models import checkpoint
from specdec.models.heads import DraftHead, build_head, load_head
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM
from specdec.models.registry import load_pretrained
from specdec.train import data, tree_temperature
from specdec.train.acceptance import evaluate, greedy_generate
from specdec.train.kv import UnrolledKV

HEADS = ("mtp", "eagle", "eagle3")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train the embedded default target and heads (CPU).")
    ap.add_argument("--out", default="specdec/assets/default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--head-steps", type=int, default=400)
    ap.add_argument("--head-batch", type=int, default=8)
    ap.add_argument("--head-lr", type=float, default=3e-3)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--reg-weight", type=float, default=0.5)
    ap.add_argument("--aux-layers", default="1,2,3")
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--gen-prompts", type=int, default=384, help="train prompts to continue greedily")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--resume-target", action="store_true",
                    help="reuse OUT/target (and its tokenizer) and train only the heads")
    return ap.parse_args(argv)


def init_weights(model: nn.Module, n_layers: int) -> None:
    """N(0, 0.02) for matrices, residual-output projections scaled by 1/sqrt(2 * n_layers)."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, std=std)
        elif name.endswith(".bias"):
            nn.init.zeros_(p)


def lr_at(step: int, steps: int, peak: float, warmup: int = 30) -> float:
    """Linear warmup then cosine decay to 10% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1))))


def make_optimizer(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in module.parameters() if p.dim() == 2]
    rest = [p for p in module.parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


@torch.no_grad()
def lm_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq: int) -> float:
    """Mean next-token cross-entropy on 32 fixed (seed 1) windows of ``stream``."""
    x = data.sample_windows(stream, 32, seq + 1, torch.Generator().manual_seed(1))
    hidden, _ = model(x[:, :-1], torch.arange(seq))
    return F.cross_entropy(model.compute_logits(hidden).flatten(0, 1), x[:, 1:].flatten()).item()


def train_target(args, stream: torch.Tensor, gen: torch.Generator, log) -> LlamaForCausalLM:
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=1024,
                         # vLLM's MiMo MTP builds its layer from the TARGET's config
                         extra={"num_nextn_predict_layers": 1})
    model = LlamaForCausalLM(config)
    init_weights(model, args.layers)
    opt = make_optimizer(model, args.target_lr)
    pos = torch.arange(args.seq)
    ema = None
    for step in range(args.target_steps):
        set_lr(opt, lr_at(step, args.target_steps, args.target_lr))
        batch = data.sample_windows(stream, args.target_batch, args.seq + 1, gen)
        hidden, _ = model(batch[:, :-1], pos)
        loss = F.cross_entropy(model.compute_logits(hidden).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == args.target_steps - 1:
            log(f"target step {step} loss {loss.item():.4f} ema {ema:.4f}")
    return model


def draft_vocab_map(tokens: torch.Tensor, vocab: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent target tokens (sorted ids) and the share of ``tokens`` they cover."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab).double()
    ids = counts.topk(size).indices.sort().values
    return ids, (counts[ids].sum() / counts.sum()).item()


def head_loss(head: DraftHead, x: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor,
              teacher_logits: torch.Tensor, draft_ids: torch.Tensor | None, unroll: int,
              reg_weight: float) -> tuple[torch.Tensor, list[float]]:
    """Unrolled self-distillation loss and per-step top-1 agreement with the target.

    x [B, T] tokens; hidden [B, T, H] target final hidden; aux [B, T, 3, H]; teacher_logits
    [B, T, V]. Step s (1-based) at slot i: input token x[i+s], position i+s-1, teacher = the
    target's distribution at position i+s.
    """
    b, t = x.shape
    pos = torch.arange(t).expand(b, t)
    h = head.combine_hidden_states(aux if head.aux_layer_ids else hidden).flatten(0, 1)
    kv, total, agree = UnrolledKV(b, t), 0.0, []
    for s in range(1, unroll + 1):
        ids = torch.cat((x[:, s:], x.new_zeros(b, s)), dim=1).reshape(-1)
        logits_hidden, h = head(ids, (pos + s - 1).reshape(-1), h, kv)
        logits = head.compute_logits(logits_hidden).view(b, t, -1)[:, : t - s]
        teacher = teacher_logits[:, s:]
        if draft_ids is not None:
            teacher = teacher[..., draft_ids]
        total = total + -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        if reg_weight and head.method in ("mtp", "eagle"):
            total = total + reg_weight * F.smooth_l1_loss(h.view(b, t, -1)[:, : t - s], hidden[:, s:])
        agree.append((logits.argmax(-1) == teacher.argmax(-1)).float().mean().item())
    return total / unroll, agree


def train_heads(args, target: LlamaForCausalLM, real: torch.Tensor, generated: torch.Tensor,
                draft_ids: torch.Tensor, gen: torch.Generator, log) -> tuple[dict, dict]:
    for p in target.parameters():
        p.requires_grad_(False)
    aux_ids = [int(i) for i in args.aux_layers.split(",")]
    d2t = draft_ids - torch.arange(len(draft_ids))
    heads = {"mtp": build_head("mtp", target), "eagle": build_head("eagle", target),
             "eagle3": build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=aux_ids,
                                  draft_vocab_size=len(draft_ids))}
    for head in heads.values():
        init_weights(head, 1)
    if hasattr(heads["eagle3"], "d2t"):
        heads["eagle3"].d2t.copy_(d2t)
    opts = {n: make_optimizer(h, args.head_lr) for n, h in heads.items()}
    half = args.head_batch // 2
    pos = torch.arange(args.seq)
    emas: dict[str, list[float]] = {}
    for step in range(args.head_steps):
        pick = torch.randint(0, len(generated), (args.head_batch - half,), generator=gen)
        x = torch.cat((data.sample_windows(real, half, args.seq, gen), generated[pick]))
        with torch.no_grad():
            hidden, aux = target(x, pos, aux_layer_ids=tuple(aux_ids))
            teacher = target.compute_logits(hidden)
        for name, head in heads.items():
            set_lr(opts[name], lr_at(step, args.head_steps, args.head_lr))
            ids = draft_ids if head.draft_vocab_size < target.config.vocab_size else None
            loss, agree = head_loss(head, x, hidden, aux, teacher, ids, args.unroll, args.reg_weight)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opts[name].step()
            cur = [loss.item()] + agree
            emas[name] = cur if name not in emas else [0.95 * e + 0.05 * c for e, c in zip(emas[name], cur)]
        if step % 25 == 0 or step == args.head_steps - 1:
            log(f"head step {step} " + " | ".join(
                f"{n} loss {e[0]:.3f} agree {' '.join(f'{a:.2f}' for a in e[1:])}" for n, e in emas.items()))
    return heads, emas


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6


def write_report(out: Path, args, argv, stats: dict) -> None:
    held = stats["held_files"]
    lines = [
        "# Embedded default: how it was trained", "",
        "Reproduce (CPU, deterministic seed):", "",
        "```", "python -m specdec.train.train_default " + " ".join(shlex.quote(a) for a in argv), "```", "",
        "Re-measure the offline acceptance estimate: `python -m specdec.train.acceptance --assets "
        f"{out}`.", "",
        "## Data", "",
        f"Python {sys.version.split()[0]} standard library `.py` files under "
        "`sysconfig.get_paths()['stdlib']`, skipping `site-packages`, `dist-packages`, `test`, "
        "`tests`, `idle_test`, `encodings` directories and files over 256 KiB.",
        "Split by path hash: a file (POSIX path relative to the stdlib root) is held out when "
        "`int(sha256(relpath)[:8], 16) % 20 == 0` (`specdec.train.data.is_held_out`).",
        f"{stats['n_train_files']} training files ({stats['train_tokens']:,} tokens), {len(held)} "
        f"held-out files ({stats['held_tokens']:,} tokens): " + ", ".join(f"`{h}`" for h in held) + ".", "",
        f"Tokenizer: byte-level BPE (`tokenizers`), vocab {args.vocab}, `<|endoftext|>` = id 0 "
        "(eos and bos), trained on the training files; `target/tokenizer.json`.", "",
        "## Models", "",
        "| folder | architecture | params | MB on disk |", "|---|---|---|---|",
    ]
    for name, (arch, params, mb) in stats["folders"].items():
        lines.append(f"| `{name}/` | {arch} | {params:,} | {mb:.2f} |")
    lines += [
        f"| total | | | {stats['total_mb']:.2f} |", "",
        f"Target: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV "
        f"heads (head_dim {args.hidden // args.heads}), SwiGLU {args.ffn}, untied lm_head, RoPE theta "
        "10000; weights stored as float16.",
        f"EAGLE-3 reads target aux layers `{args.aux_layers}` and drafts over the "
        f"{args.draft_vocab} most frequent target-greedy tokens of its training data (`d2t`; they "
        f"cover {stats['draft_coverage']:.1%} of them). The MTP folder also holds copies of the "
        "target's embedding and lm_head because vLLM's MiMo loader requires them.", "",
        "## Training", "",
        f"Wall time {stats['wall_s'] / 60:.1f} min on {args.threads} CPU threads "
        f"(target {stats['target_s'] / 60:.1f} min, data generation {stats['gen_s'] / 60:.1f} min, "
        f"heads {stats['heads_s'] / 60:.1f} min).", "",
        f"- Target: {args.target_steps} steps x {args.target_batch} x {args.seq} tokens, AdamW lr "
        f"{args.target_lr} (warmup 30, cosine to 10%); final loss on 32 fixed windows: train "
        f"{stats['target_loss']:.3f}, held-out {stats['target_held_loss']:.3f} nats/token.",
        f"- Heads: {args.head_steps} steps x {args.head_batch} x {args.seq} tokens (half real "
        f"windows, half {args.prompt_len}-token train prompts + target greedy continuation, "
        f"{args.gen_prompts} such sequences), AdamW lr {args.head_lr}, unrolled {args.unroll} "
        f"steps, soft cross-entropy to the frozen fp16 target (+{args.reg_weight} x smooth-L1 "
        "hidden regression for MTP/EAGLE).", "",
        "| head | final loss (EMA) | train top-1 agreement per step (EMA) |", "|---|---|---|",
    ]
    for name, ema in stats["head_emas"].items():
        lines.append(f"| {name} | {ema[0]:.3f} | {' / '.join(f'{a:.3f}' for a in ema[1:])} |")
    lines += [
        "", "## Offline acceptance estimate (K = 3, greedy, held-out)", "",
        f"{args.eval_prompts} held-out prompts of {args.prompt_len} tokens "
        "(`data.heldout_prompts(seed=0)`), each continued greedily by the target for "
        f"{args.seq - args.prompt_len} tokens; every slot of the generated part runs the draft "
        "chain teacher-forced (`acceptance.draft_chain`, draft KV as the engine holds it). "
        "Per-position = P(draft s accepted | drafts 1..s-1 accepted); mean acceptance length "
        "counts the bonus token (1 = nothing accepted). Weights loaded from the saved fp16 files.", "",
        "| head | position 1 | position 2 | position 3 | mean acceptance length | slots | "
        "real-text step-1 agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    acc = stats["acceptance"]
    for name in HEADS:
        r = acc[name]
        pp = " | ".join(f"{a:.3f}" for a in r["per_position"])
        lines.append(f"| {name} | {pp} | {r['mean_acceptance_length']:.3f} | {r['slots']} | "
                     f"{r['real_text_step1_agreement']:.3f} |")
    lines += [
        "", f"Caveat: the tiny target's greedy continuations are repetitive ({acc['repeated_4gram_share']:.0%} "
        "of their 4-grams already occurred earlier in the same sequence), which is what a greedy "
        "engine run sees and what makes late positions easy. The last column is a harder, exact "
        "number: on 32 real held-out windows, how often the first draft equals the target's greedy "
        "next token (a round started inside real text).", "",
        *tree_temperature.report_lines(stats["tree_temperatures"]),
    ]
    (out / "TRAINING.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    train_files, held_files = data.list_files()
    train_texts = data.read_texts(train_files)
    if args.resume_target:
        tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    else:
        tok = data.train_tokenizer(train_texts, args.vocab)
    stream = data.encode_stream(tok, train_texts)
    held_stream = data.encode_stream(tok, data.read_texts(held_files))
    log(f"{len(train_files)} train files ({len(stream)} tokens), {len(held_files)} held-out ({len(held_stream)})")

    if not args.resume_target:
        target = train_target(args, stream, torch.Generator().manual_seed(args.seed), log)
        target.save_pretrained(out / "target", torch.float16)
        tok.save(str(out / "target" / "tokenizer.json"))
    target_s = time.time() - t0
    target = load_pretrained(out / "target")  # heads learn the deployed (fp16-rounded) target
    losses = {name: lm_loss(target, s, args.seq) for name, s in (("train", stream), ("held", held_stream))}
    log(f"target ready; loss on 32 fixed windows: {losses}")

    # Heads use their own seeds, so --resume-target reproduces a full run's heads exactly.
    torch.manual_seed(args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = data.sample_windows(stream, args.gen_prompts, args.prompt_len, gen)
    generated = greedy_generate(target, prompts, args.seq - args.prompt_len)
    draft_ids, coverage = draft_vocab_map(generated[:, args.prompt_len:], args.vocab, args.draft_vocab)
    gen_s = time.time() - t0 - target_s
    log(f"generated {tuple(generated.shape)}; draft vocab covers {coverage:.3f}")

    heads, emas = train_heads(args, target, stream, generated, draft_ids, gen, log)
    for name, head in heads.items():
        head.save_pretrained(out / name, torch.float16)
    heads_s = time.time() - t0 - target_s - gen_s

    heads = {name: load_head(out / name, target) for name in HEADS}  # as saved (fp16)
    acceptance = evaluate(target, heads, tok, args.eval_prompts, args.prompt_len,
                          args.seq - args.prompt_len)
    log(f"acceptance {acceptance}")
    temperatures = tree_temperature.fit(target, heads, tok)
    tree_temperature.write({name: out / name for name in heads}, temperatures)
    log(f"tree score temperatures {temperatures}")
    folders = {}
    for name in ("target",) + HEADS:
        arch = checkpoint.load_config(out / name)["architectures"][0]
        params = sum(t.numel() for t in checkpoint.load_tensors(out / name).values())
        folders[name] = (arch, params, folder_mb(out / name))
    stats = dict(held_files=held_files, n_train_files=len(train_files), train_tokens=len(stream),
                 held_tokens=len(held_stream), folders=folders,
                 total_mb=sum(f[2] for f in folders.values()), draft_coverage=coverage,
                 wall_s=time.time() - t0, target_s=target_s, gen_s=gen_s, heads_s=heads_s,
                 target_loss=losses["train"], target_held_loss=losses["held"], head_emas=emas,
                 acceptance=acceptance, tree_temperatures=temperatures)
    write_report(out, args, argv, stats)
    log(f"done; {stats['total_mb']:.2f} MB in {out}")


if __name__ == "__main__":
    main()
