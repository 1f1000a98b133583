"""Messages that misled a vLLM user (issue 51, item 5): a missing default head names the folder
looked for and how to give one; suffix's K on the command line is the tree depth, as in the
API and vLLM; an unknown ``specdec bench`` flag is named, not read as a subcommand; the
``generate`` table says whether its tok/s is cold."""

import os
import shutil

import pytest

from specdec import LLM
from specdec.commands.cli import build_parser, main
from specdec.config import SpeculativeConfig
from specdec.flags import speculation_from_args, speculative_config

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def headless(folder, tmp_path_factory):
    """conftest's target alone: no sibling heads."""
    target = tmp_path_factory.mktemp("headless") / "target"
    shutil.copytree(folder / "target", target)
    return target


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_missing_default_head_names_the_folder_looked_for(headless, method):
    with pytest.raises(ValueError) as e:
        LLM(headless, speculative_config={"method": method, "num_speculative_tokens": 2},
            max_model_len=32)
    msg = str(e.value)
    assert "speculative_config.model='" not in msg  # a path the caller never gave
    assert (f"method={method!r} needs its head's folder: no speculative_config.model was "
            f"given, and the default, the target folder's sibling "
            f"'{headless.parent.resolve() / method}', has no config.json") in msg
    assert """--speculative-config '{"model": "DIR"}'""" in msg
    if method == "mtp":  # why the target folder itself is not the head
        assert "not a MiMoForCausalLM" in msg


def test_the_command_with_a_relative_model_names_the_absolute_folder(headless, capsys):
    cwd = os.getcwd()
    os.chdir(headless.parent)
    try:
        code = main(["generate", "--model", "target", "--prompt", PROMPT, "--method", "eagle3"])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"sibling '{headless.parent.resolve() / 'eagle3'}'" in err
    assert "speculative_config.model='eagle3'" not in err


def test_suffix_k_is_the_depth_on_the_command_line_as_in_the_api():
    api = SpeculativeConfig.from_dict({"method": "suffix"}).num_speculative_tokens
    assert api == 24
    assert speculative_config("suffix", 3, True, k_given=False)["num_speculative_tokens"] == api
    assert speculative_config("suffix", 5, True)["num_speculative_tokens"] == 5  # -k 5
    depth = '{"suffix_decoding_max_tree_depth": 8}'
    assert speculative_config("suffix", 3, True, depth, k_given=False)[
        "num_speculative_tokens"] == 8
    assert speculative_config("none", 3, True, '{"method": "suffix", "num_speculative_tokens": '
                              '4}', k_given=False)["num_speculative_tokens"] == 4
    for argv, k in ((["serve", "--method", "suffix"], 24),
                    (["serve", "--method", "suffix", "-k", "2"], 2),
                    (["serve", "--method", "eagle3"], 3)):
        assert speculation_from_args(build_parser().parse_args(argv))[
            "num_speculative_tokens"] == k


@pytest.mark.parametrize("argv", [["bench", "--random-prefix-len", "8", "--quick"],
                                  ["bench", "--random-input-len=32", "x"]])
def test_an_unknown_bench_flag_is_named(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    flag = argv[1].split("=")[0]
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid choice" not in err
    assert f"unrecognized arguments: {argv[1]} (not a flag of specdec bench" in err, err
    assert flag in err and "subcommands: serve" in err
    with pytest.raises(SystemExit):  # a real bad subcommand is still one
        main(["bench", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_the_generate_table_says_cold_or_warm(folder, capsys):
    argv = ["generate", "--model", str(folder / "target"), "--prompt", PROMPT, "--max-tokens",
            "4", "--method", "eagle3", "-k", "2"]
    assert main(argv) == 0
    cold = " ".join(capsys.readouterr().out.split())
    assert "tok/s: this process's first run, cold" in cold and "timed warm" not in cold
    assert main([*argv, "--compare-plain"]) == 0
    warm = " ".join(capsys.readouterr().out.split())
    assert "tok/s: timed warm (after a first run of the prompt)" in warm and "cold" not in warm
