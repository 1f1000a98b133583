"""The ``specdec`` command: ``specdec generate`` (one prompt) and ``specdec bench`` (ITL harness).

    specdec generate --prompt "def fibonacci(n):" --method eagle3 -k 3
    specdec generate --prompt "x = " --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'
    specdec bench --quick --out /tmp/bench
    specdec serve --method eagle3 -k 3 --port 8000        # needs the serve extra
    specdec bench serve --launch --quick --out /tmp/bench-serve

A bad flag or a bad speculative config prints one line on stderr and exits with status 2.
This module only dispatches: ``specdec.commands.generate`` (generate), ``specdec.bench``
(bench, bench serve), ``specdec.entrypoints.serve`` (serve); what they share (method names,
engine flags, building an LLM, UsageError) is in ``specdec.flags``.
"""

import argparse
import functools
import importlib.metadata
import sys

from specdec.commands.generate import add_generate_parser
from specdec.flags import OneLineParser, UsageError, document_defaults


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="ITL benchmark sweep (also: python -m specdec.bench.itl)",
                       description="Inter-token-latency benchmark sweep; see specdec/bench/itl.py.")
    itl = import_bench()
    itl.add_arguments(p)
    p.set_defaults(func=itl.run_from_args)
    from specdec.bench import multiturn
    from specdec.bench import serve as bench_serve
    endpoint = p.add_subparsers(dest="bench_target", parser_class=OneLineParser).add_parser(
        "serve", help="measure an OpenAI-compatible endpoint (specdec serve, vllm serve)",
        description=bench_serve.__doc__.split("\n")[0])
    bench_serve.add_arguments(endpoint)
    endpoint.set_defaults(func=functools.partial(bench_serve.run_from_args,
                                                 turns_bench=multiturn.bench))


def add_serve_parser(sub) -> None:
    from specdec.entrypoints import serve
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)",
                       description="An OpenAI-compatible server (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /metrics) over a "
                                   "speculative engine in its own process; SIGTERM drains the "
                                   "running requests.")
    serve.add_arguments(p)
    p.set_defaults(func=serve.run_from_args)


def import_bench():
    """The ITL harness (``specdec/bench/itl.py``)."""
    from specdec.bench import itl
    return itl


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specdec", description="Speculative decoding with padded drafters.")
    parser.add_argument("--version", action="version",
                        version=f"specdec {importlib.metadata.version('specdec')}")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    document_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # plain ``specdec``: say what it can do
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except UsageError as e:
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
