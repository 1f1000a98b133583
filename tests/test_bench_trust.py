"""Issue 13, item 4: the bench says when its figures are not to be trusted, and reads well."""

import json

from rich.console import Console

from specdec.bench import itl
from test_bench import bench  # noqa: F401 (the module's sweep, run through the command line)


def test_results_record_load_cpus_and_threads(bench):  # noqa: F811
    out, r = bench
    env = r["environment"]
    for key in ("load_average_1_5_15min", "load_average_at_start_1_5_15min"):
        assert len(env[key]) == 3 and all(x >= 0 for x in env[key])
    assert env["cpu_count"] >= 1 and env["torch_threads"] >= 1
    assert isinstance(r["warnings"], list)
    assert json.loads((out / "results.json").read_text())["warnings"] == r["warnings"]


def test_load_warning():
    env = dict(cpu_count=2, torch_threads=2, load_average_1_5_15min=[0.2, 0.1, 0.1],
               load_average_at_start_1_5_15min=[5.0, 4.0, 3.0])
    (line,) = itl.load_warnings(env)
    assert "load average 5.0 on 2 CPUs" in line
    assert itl.load_warnings({**env, "load_average_at_start_1_5_15min": [0.5, 0, 0]}) == []


def pair(mean_padded, std_padded, mean_ragged, std_ragged):
    def config(mode, mean, std):
        return dict(status="ok", method="mtp", k=3, concurrency=4, prompt_len=32, output_len=32,
                    mode=mode, summary=dict(spread=dict(itl_mean_ms=dict(mean=mean, std=std))))
    return [config("padded", mean_padded, std_padded), config("ragged", mean_ragged, std_ragged)]


def test_spread_larger_than_the_difference_is_flagged():
    (line,) = itl.comparison_warnings(pair(4.0, 0.5, 4.2, 0.1))
    assert "mtp K=3 conc=4" in line and "0.200 ms" in line and "0.500 ms std" in line
    assert itl.comparison_warnings(pair(4.0, 0.5, 6.0, 0.1)) == []


def test_bands_are_percentiles_and_never_below_zero():
    mid, (below, above) = itl.percentile_band([dict(mean=5.0, p10=4.0, p90=9.0),
                                               dict(mean=0.3, p10=0.05, p90=3.0)])
    assert mid == [5.0, 0.3] and below == [1.0, 0.25] and above == [4.0, 2.7]
    assert all(m - b >= 0 for m, b in zip(mid, below))


def test_padded_and_ragged_differ_in_colour_and_marker():
    palette = [f"c{i}" for i in range(20)]
    padded = itl.series_style("mtp", "padded", 1, palette)
    ragged = itl.series_style("mtp", "ragged", 1, palette)
    assert padded["color"] != ragged["color"] and padded["marker"] != ragged["marker"]


def test_table_fits_a_100_column_terminal(bench):  # noqa: F811
    _, r = bench
    console = Console(record=True, width=100)
    console.print(itl.results_table(r))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "…" not in text
