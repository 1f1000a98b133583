"""lm-evaluation-harness against ``specdec serve``: the completions API as evaluation tools
use it (token-id prompts, several per request, ``echo`` + ``logprobs``, stop strings), checked
against the in-process engine.

For each method (default: plain and EAGLE-3) the script launches ``specdec serve`` on the
embedded model (or ``--model DIR``), runs lm-eval's ``local-completions`` model on two small
local tasks written here (a multiple-choice task: loglikelihood requests; a generate_until
task) with lm-eval's default settings (token-id requests, the server's tokenizer through
``tokenizer_backend=remote``) at each ``--batch-size``, and compares every logged
loglikelihood with the in-process engine's (``LLM.generate`` with ``prompt_logprobs`` over
the same token ids, tokenized by lm-eval's own rule). Needs lm-eval (not a test dependency):

    pip install "lm-eval==0.4.13" && pip install -e '.[serve]'
    python -m benchmarks.lm_eval_serve --methods none,eagle3 --batch-size 1,2 \
        --tokenized-requests true,false

Prints per run: method, batch size, requests, accuracy, max |loglikelihood - in-process| and
whether lm-eval's is_greedy agrees with the engine's argmax everywhere; then whether the
generate_until texts are the same in every run.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

from specdec.bench.serve import launch, stop

MAX_MODEL_LEN = 512
# multiple choice: (question, choices, index of the answer); code the embedded model knows
MC = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
    ("for i in range(10):\n    print(", ["i)", "10)", "range)"], 0),
    ("import os\nimport", [" sys", " os", " 42"], 0),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " {}", " 0"], 0),
    ("if __name__ ==", [" \"__main__\":", " 'main'", " None:"], 0),
    ("with open(path) as", [" f:", " path:", " open:"], 0),
    ("def fibonacci(n):\n    if n <", [" 2:", " 0:", " n:"], 0),
    ("try:\n    x = int(s)\nexcept", [" ValueError:", " x:", " int:"], 0),
    ("return self.", ["items", "return", "def"], 0),
    ("    def __len__(self):\n        return len(self.", ["items)", "len)", "self)"], 0),
    ("x = [i * i for i in", [" range(n)]", " x]", " i]"], 0),
    ("print(\"Hello,", [" world!\")", " Hello\")", " print\")"], 0),
    ("while True:\n    line = input()\n    if not", [" line:", " True:", " input:"], 0),
    ("def __init__(self", [", name):", ")):", " self"], 0),
    ("import numpy as", [" np", " pd", " os"], 0),
    ("    except Exception as", [" e:", " x:", " Exception:"], 0),
    ("d = {}\nfor k, v in d.", ["items():", "keys(", "values(v)"], 0),
    ("assert len(x) ==", [" 3", " x", " len"], 0),
    ("lambda x:", [" x + 1", " lambda", " def"], 0),
    ("from collections import", [" defaultdict", " os", " import"], 0),
    ("    @property\n    def", [" name(self):", " property:", " def"], 0),
    ("s = \"\".join(", ["parts)", "join)", "s)"], 0),
    ("raise ValueError(", ["\"bad value\")", "ValueError)", "raise)"], 0),
    ("self.assertEqual(", ["a, b)", "self)", "assert)"], 0),
]
GEN = ["def add(a, b):\n", "import os\nimport", "class Stack:\n", "for i in range(10):\n",
       "def fibonacci(n):\n", "with open(path) as f:\n", "if __name__ == \"__main__\":\n",
       "try:\n", "return self.", "def foo"]


def write_tasks(folder: Path) -> list[str]:
    """Two lm-eval tasks over local JSON lines in ``folder``; -> their names."""
    with open(folder / "mc.jsonl", "w") as f:
        for q, choices, answer in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for p in GEN:
            f.write(json.dumps({"prompt": p, "target": ""}) + "\n")
    common = "dataset_path: json\ntest_split: train\n"
    (folder / "specdec_mc.yaml").write_text(
        f"task: specdec_mc\n{common}dataset_kwargs:\n  data_files: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "specdec_gen.yaml").write_text(
        f"task: specdec_gen\n{common}dataset_kwargs:\n  data_files: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\n"
        "doc_to_target: \"{{target}}\"\ntarget_delimiter: \"\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    return ["specdec_mc", "specdec_gen"]


def in_process_loglikelihoods(llm, pairs: list[list[int]], split: list[int]
                              ) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether each continuation token is the
    argmax) per token list ``pairs[i]`` whose continuation starts at ``split[i]``."""
    from specdec.engine.sequence import SamplingParams
    outs = llm.generate(pairs, SamplingParams(max_tokens=1, prompt_logprobs=1))
    result = []
    for out, start in zip(outs, split):
        entries = out.prompt_logprobs[start:]
        result.append((sum(e.logprob for e in entries), all(e.rank == 1 for e in entries)))
    return result


def run(method: str, batch_size: int, tokenized: bool, args, tasks: list[str], folder: Path,
        llm) -> dict:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    serve_args = ["--method", method, "--max-model-len", str(MAX_MODEL_LEN)]
    proc, url = launch(serve_args + (["--model", args.model] if args.model else []),
                       timeout_s=600.0)
    try:
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions",
                                 model=name, tokenizer_backend="remote",
                                 batch_size=batch_size, max_length=MAX_MODEL_LEN,
                                 tokenized_requests=tokenized)
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=True,
                                      task_manager=TaskManager(include_path=str(folder)))
        samples = out["samples"]["specdec_mc"]
        served = [r[0] for s in samples for r in s["resps"]]
        pairs, split = [], []  # the token ids lm-eval sent: its own rule, its tokenizer
        for s in samples:
            for context, continuation in s["arguments"]:
                ctx, cont = lm._encode_pair(context, continuation)
                pairs.append(ctx + cont)
                split.append(len(ctx))
    finally:
        stop(proc)
    mine = in_process_loglikelihoods(llm, pairs, split)
    diff = max(abs(float(s[0]) - m[0]) for s, m in zip(served, mine))
    greedy_agrees = all(bool(s[1]) == m[1] for s, m in zip(served, mine))
    gen = out["samples"]["specdec_gen"]
    return {"method": method, "batch_size": batch_size, "tokenized_requests": tokenized,
            "loglikelihood_requests": len(served),
            "acc": out["results"]["specdec_mc"]["acc,none"],
            "generations": [s["resps"][0][0] for s in gen],
            "max_abs_diff": diff, "is_greedy_agrees": greedy_agrees}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="none,eagle3")
    p.add_argument("--batch-size", default="1,2")
    p.add_argument("--tokenized-requests", default="true",
                   help="lm-eval's tokenized_requests values to run: true (its default: "
                        "token-id prompts), false (text prompts), or true,false")
    p.add_argument("--model", default=None, help="a checkpoint folder (default: embedded)")
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)
    from specdec.engine.llm import LLM
    llm = LLM(args.model, max_model_len=MAX_MODEL_LEN)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp))
        runs = [(m, bs, t == "true") for m in args.methods.split(",")
                for bs in map(int, args.batch_size.split(","))
                for t in args.tokenized_requests.split(",")]
        for method, bs, tokenized in runs:
            rows.append(run(method, bs, tokenized, args, tasks, Path(tmp), llm))
            r = rows[-1]
            print(f"{method:8s} batch {bs} tokenized_requests={tokenized}: "
                  f"{r['loglikelihood_requests']} loglikelihoods, "
                  f"acc {r['acc']:.3f}, max |served - in-process| {r['max_abs_diff']:.2e}, "
                  f"is_greedy agrees: {r['is_greedy_agrees']}", flush=True)
    same_text = all(r["generations"] == rows[0]["generations"] for r in rows)
    print(f"generate_until: {len(rows[0]['generations'])} texts, equal across runs: "
          f"{same_text}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
