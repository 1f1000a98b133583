"""Issue 13, item 16: data-parallel faults fail fast and say what happened.

A stalled rank (SIGSTOP) fails the call at ``LLM(data_parallel_timeout=...)``; a killed rank
is named with its signal; ranks exit when their parent dies; config errors are one line at
any DP size. Real rank processes, real signals.
"""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from specdec.commands.cli import main
from specdec.engine.llm import LLM

from helpers import exited

LONG_JOB = dict(prompts=[[1, 2, 3]] * 64, max_tokens=400, ignore_eos=True)


def signal_a_rank_later(sig: int, rank: int, delay: float) -> threading.Thread:
    """Once both ranks are running, wait ``delay`` s and send ``sig`` to rank ``rank``."""
    def send():
        name = f"specdec-rank-{rank}"
        while not (proc := [p for p in mp.active_children() if p.name == name]):
            time.sleep(0.05)
        time.sleep(delay)
        os.kill(proc[0].pid, sig)
    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def test_a_stalled_rank_fails_the_call_at_the_llm_timeout():
    """The job alone ends well within the timeout (~4 s with the ranks' start on 2 cores):
    only the stall makes the call time out."""
    llm = LLM(data_parallel_size=2, data_parallel_timeout=10)
    signal_a_rank_later(signal.SIGSTOP, 1, 0.5)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="within 10"):
        llm.generate([[1, 2, 3]] * 64, max_tokens=80, ignore_eos=True)
    assert time.monotonic() - start < 10 + 15


def test_a_killed_rank_is_named_with_its_signal():
    llm = LLM(data_parallel_size=2)
    signal_a_rank_later(signal.SIGKILL, 1, 1.0)
    with pytest.raises(RuntimeError, match="rank 1 killed by SIGKILL"):
        llm.generate(**LONG_JOB)


PARENT = textwrap.dedent("""
    import multiprocessing as mp, threading, time
    from specdec import LLM

    def report():
        while len(mp.active_children()) < 2:
            time.sleep(0.05)
        print(" ".join(str(p.pid) for p in mp.active_children()), flush=True)

    if __name__ == "__main__":
        threading.Thread(target=report, daemon=True).start()
        LLM(data_parallel_size=2).generate([[1, 2, 3]] * 64, max_tokens=400, ignore_eos=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_exit_when_the_parent_dies(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(1.5)  # the ranks are generating
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not all(exited(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(exited(p) for p in pids), "a rank outlived its parent"
    finally:
        parent.kill()


@pytest.mark.parametrize("argv,needle", [
    (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2, '
      '"draft_model_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}'],
     "combines target layers [1, 2, 3] (as trained)"),
    (["--temperature", "nan"], "--temperature=nan"),
    (["--seed", "-2"], "seed=-2"),
])
def test_cli_errors_are_one_line_at_dp_2(capsys, argv, needle):
    code = main(["generate", "--prompt", "x", "--dp", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("kind,kwargs", [("data-parallel", "data_parallel_size=2"),
                                         ("tensor-parallel", "tensor_parallel_size=2")])
def test_a_script_without_a_main_guard_is_told_what_to_add(tmp_path, kind, kwargs):
    """Issue 37, item 5: spawn imports the script again in every rank; an unguarded one ends
    with one line naming the rank kind and the guard to add, and no rank's traceback."""
    script = tmp_path / "run.py"
    script.write_text("from specdec import LLM\n"
                      f"print(LLM({kwargs}).generate(['def f('], max_tokens=2)[0].token_ids)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and f"the {kind} rank processes ran this script again" in last
    assert 'if __name__ == "__main__":' in last and "bootstrapping" not in r.stderr
