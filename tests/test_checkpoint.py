"""Checkpoint folders in every layout transformers writes (one model.safetensors, safetensors
shards + index from save_folder and from transformers, pytorch_model.bin, .bin shards + index)
load the same tensors; load_into streams them into preallocated (view) tensors one file at a
time; errors name the folder, file, index and tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.models.checkpoint import (WEIGHTS_NAMES, iter_tensors, load_into, load_tensors,
                                       save_folder, weight_files)

CONFIG = {"architectures": ["Toy"]}
MAX_SHARD = 1500  # bytes: TENSORS below cut into SHARDS
SHARDS = [["big"], ["d2t"], ["embed.weight"], ["layers.0.w", "layers.1.b"], ["layers.1.w"]]
BIN_SHARDS = {"pytorch_model-00001-of-00002.bin": ["big", "d2t", "embed.weight"],
              "pytorch_model-00002-of-00002.bin": ["layers.0.w", "layers.1.b", "layers.1.w"]}
needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def make_tensors() -> dict[str, torch.Tensor]:
    """float32 tensors of 4096, 2048, 1024, 1024 and 64 bytes, and an int64 one of 64 bytes."""
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(64, 16, generator=g), "d2t": torch.arange(8) * 3,
            "embed.weight": torch.randn(32, 16, generator=g),
            "layers.0.w": torch.randn(16, 16, generator=g),
            "layers.1.b": torch.randn(16, generator=g),
            "layers.1.w": torch.randn(16, 16, generator=g)}


def save_bin_shards(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``BIN_SHARDS`` + ``pytorch_model.bin.index.json``, as transformers wrote them before
    safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    for file, names in BIN_SHARDS.items():
        torch.save({k: tensors[k] for k in names}, folder / file)
    # the last file first: weight_files sorts them
    weight_map = {k: file for file, names in reversed(BIN_SHARDS.items()) for k in names}
    write_index(folder / "pytorch_model.bin.index.json", weight_map)


def write_index(file: Path, weight_map: dict[str, str]) -> None:
    file.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def shards_mapped(folder: Path) -> set[str]:
    """The files of ``folder`` this process has memory-mapped now."""
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if str(folder) in line}


@pytest.fixture
def layouts(tmp_path) -> dict[str, Path]:
    """make_tensors() saved in the four layouts (float32, so the values stay exact)."""
    tensors, out = make_tensors(), {}
    for kind in ("single", "sharded", "bin", "bin_sharded"):
        out[kind] = tmp_path / kind
    save_folder(out["single"], CONFIG, tensors, torch.float32)
    save_folder(out["sharded"], CONFIG, tensors, torch.float32, max_shard_bytes=MAX_SHARD)
    out["bin"].mkdir()
    torch.save(tensors, out["bin"] / "pytorch_model.bin")
    save_bin_shards(out["bin_sharded"], tensors)
    return out


def test_four_layouts_load_the_same_tensors(layouts):
    tensors = make_tensors()
    assert weight_files(layouts["single"]) == [layouts["single"] / "model.safetensors"]
    assert weight_files(layouts["bin"]) == [layouts["bin"] / "pytorch_model.bin"]
    assert weight_files(layouts["bin_sharded"]) == [layouts["bin_sharded"] / f for f in BIN_SHARDS]
    shard_files = [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert weight_files(layouts["sharded"]) == [layouts["sharded"] / f for f in shard_files]
    for kind, folder in layouts.items():
        assert_same(load_tensors(folder), tensors)
        assert [name for name, _ in iter_tensors(folder)] == sorted(tensors), kind  # file order


def test_save_folder_shards_greedily_in_name_order_with_the_transformers_index(layouts):
    """At most MAX_SHARD bytes a file, except 'big' (4096 bytes) alone; the index as
    save_pretrained writes it; no model.safetensors beside the shards."""
    folder, tensors = layouts["sharded"], make_tensors()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
        + ["config.json", "model.safetensors.index.json"])
    for i, names in enumerate(SHARDS, 1):
        assert sorted(load_file(folder / f"model-{i:05d}-of-00005.safetensors")) == names
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                     "weight_map": {k: f"model-{i:05d}-of-00005.safetensors"
                                    for i, names in enumerate(SHARDS, 1) for k in names}}


def test_save_folder_small_enough_is_one_file_and_a_new_save_replaces_the_old(tmp_path):
    tensors = make_tensors()
    doubled = {k: v * 2 for k, v in tensors.items()}
    save_folder(tmp_path, CONFIG, tensors, torch.float32, max_shard_bytes=10**6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    save_folder(tmp_path, CONFIG, doubled, torch.float32, max_shard_bytes=MAX_SHARD)
    assert not (tmp_path / "model.safetensors").exists()  # it would shadow the new shards
    assert_same(load_tensors(tmp_path), doubled)
    save_folder(tmp_path, CONFIG, tensors, torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_bytes"):
            save_folder(tmp_path, CONFIG, tensors, torch.float32, max_shard_bytes=bad)


def test_layouts_are_taken_in_order_of_preference(tmp_path):
    """With all four present, each named file wins over the ones after it."""
    save_file({"x": torch.tensor([0.0])}, tmp_path / "model.safetensors")
    save_file({"x": torch.tensor([1.0])}, tmp_path / "s.safetensors")
    write_index(tmp_path / "model.safetensors.index.json", {"x": "s.safetensors"})
    torch.save({"x": torch.tensor([2.0])}, tmp_path / "pytorch_model.bin")
    torch.save({"x": torch.tensor([3.0])}, tmp_path / "b.bin")
    write_index(tmp_path / "pytorch_model.bin.index.json", {"x": "b.bin"})
    for i, name in enumerate(WEIGHTS_NAMES):
        assert load_tensors(tmp_path)["x"].item() == i, name
        (tmp_path / name).unlink()


def test_transformers_sharded_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    files = weight_files(tmp_path)
    assert len(files) > 2 and all(f.suffix == ".safetensors" for f in files), files
    want = model.state_dict()
    if cfg.tie_word_embeddings:  # a tied lm_head is not saved
        del want["lm_head.weight"]
    assert_same(load_tensors(tmp_path), want)
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(cfg)  # other weights, loaded through views
    load_into(fresh.state_dict(), tmp_path)
    assert_same(fresh.state_dict(), want)


def test_legacy_bin_is_read(tmp_path):
    """pytorch_model.bin from torch < 1.6 (not a zip, so not memory-mappable)."""
    torch.save(make_tensors(), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert_same(load_tensors(tmp_path), make_tensors())


@needs_proc
@pytest.mark.parametrize("kind", ["sharded", "bin_sharded"])
def test_iter_tensors_maps_one_file_at_a_time(layouts, kind):
    files = {str(f) for f in weight_files(layouts[kind])}
    seen = set()
    for _, t in iter_tensors(layouts[kind]):
        mapped = shards_mapped(layouts[kind])
        assert len(mapped) == 1 and mapped <= files, mapped
        seen |= mapped
        del t
    assert seen == files


def test_load_into_writes_through_row_views_and_casts(tmp_path):
    """A merged [6, 4] parameter (requires grad) loaded as rows 'a' [2, 4] and 'b' [4, 4] from
    bfloat16 shards."""
    src = {"a": torch.arange(8.0).view(2, 4), "b": torch.arange(16.0).view(4, 4) + 100}
    save_folder(tmp_path, CONFIG, src, torch.bfloat16, max_shard_bytes=20)
    assert len(weight_files(tmp_path)) == 2
    big = torch.nn.Parameter(torch.zeros(6, 4))
    load_into({"a": big[:2], "b": big[2:]}, tmp_path)
    assert big.dtype == torch.float32 and torch.equal(big.data, torch.cat([src["a"], src["b"]]))


def test_load_into_names_missing_unexpected_and_wrong_shapes_at_once(layouts):
    folder = layouts["sharded"]
    dest = {"embed.weight": torch.zeros(32, 16), "layers.0.w": torch.zeros(16, 8),
            "layers.1.w": torch.zeros(15, 16), "gone": torch.zeros(1), "absent": torch.zeros(1),
            "big": torch.zeros(64, 16), "layers.1.b": torch.zeros(16)}
    with pytest.raises(ValueError) as e:
        load_into(dest, folder)
    assert str(e.value) == (
        f"checkpoint {str(folder)!r}: missing tensors ['absent', 'gone'], unexpected tensors "
        "['d2t'], wrong shapes ['layers.0.w: got (16, 16) != expected (16, 8)', "
        "'layers.1.w: got (16, 16) != expected (15, 16)']")
    assert torch.equal(dest["embed.weight"], make_tensors()["embed.weight"])  # the rest loaded
    del dest["gone"], dest["absent"]
    dest["layers.0.w"], dest["layers.1.w"] = torch.zeros(16, 16), torch.zeros(16, 16)
    with pytest.raises(ValueError) as e:
        load_into(dest, folder)
    assert str(e.value) == f"checkpoint {str(folder)!r}: unexpected tensors ['d2t']"


def test_load_into_rename_and_ignore(layouts):
    """Checkpoint 'layers.i.w' -> dest 'blocks.i'; 'big' renamed away (None); 'd2t' ignored."""
    want = make_tensors()
    dest = {"blocks.0": torch.zeros(16, 16), "blocks.1": torch.zeros(16, 16),
            "embed.weight": torch.zeros(32, 16), "layers.1.b": torch.zeros(16)}

    def rename(name: str) -> str | None:
        if name == "big":
            return None
        return f"blocks.{name.split('.')[1]}" if name.endswith(".w") else name

    load_into(dest, layouts["single"], rename=rename, ignore=lambda n: n == "d2t")
    assert torch.equal(dest["blocks.0"], want["layers.0.w"])
    assert torch.equal(dest["blocks.1"], want["layers.1.w"])
    with pytest.raises(ValueError, match=r"unexpected tensors \['d2t'\]$"):
        load_into(dest, layouts["single"], rename=rename)
    with pytest.raises(ValueError, match=r"missing tensors \['blocks.0', 'blocks.1'\], "
                                         r"unexpected tensors \['big', 'layers.0.w'"):
        load_into(dest, layouts["single"], ignore=lambda n: n == "d2t")


def test_no_weights_names_the_folder_and_the_four_names(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for fn in (weight_files, load_tensors, lambda p: load_into({}, p)):
        with pytest.raises(ValueError) as e:
            fn(tmp_path)
        assert str(tmp_path) in str(e.value)
        assert all(name in str(e.value) for name in WEIGHTS_NAMES), e.value


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])


@pytest.mark.parametrize("kind, file, needle", [
    ("single", "model.safetensors", "not a readable safetensors file"),
    ("sharded", "model-00003-of-00005.safetensors", "not a readable safetensors file"),
    ("bin", "pytorch_model.bin", "not a readable PyTorch weights file"),
    ("bin_sharded", "pytorch_model-00002-of-00002.bin", "not a readable PyTorch weights file"),
])
def test_truncated_weights_file_is_named(layouts, kind, file, needle):
    truncate(layouts[kind] / file)
    with pytest.raises(ValueError, match=needle) as e:
        load_tensors(layouts[kind])
    assert str(e.value).startswith(f"{layouts[kind] / file}: ")
    assert "\n" not in str(e.value)


def test_bin_that_is_not_a_state_dict_is_named(tmp_path):
    for bad, what in (([torch.ones(1)], "holds a list"), ({"a": 1}, "'a' holds a int")):
        torch.save(bad, tmp_path / "pytorch_model.bin")
        with pytest.raises(ValueError, match=f"pytorch_model.bin: not a readable PyTorch weights "
                                             f"file .*{what}"):
            load_tensors(tmp_path)


@pytest.mark.parametrize("kind, index", [("sharded", "model.safetensors.index.json"),
                                         ("bin_sharded", "pytorch_model.bin.index.json")])
def test_index_naming_a_missing_shard_is_named(layouts, kind, index):
    shard = weight_files(layouts[kind])[1]
    shard.unlink()
    with pytest.raises(ValueError) as e:
        weight_files(layouts[kind])
    assert str(e.value).startswith(f"{layouts[kind] / index}: ") and shard.name in str(e.value)


@pytest.mark.parametrize("kind, edit, needle", [
    ("sharded", lambda m: m.update({"layers.0.w": m["big"]}),
     "tensor 'layers.0.w' is in model-00004-of-00005.safetensors but the index maps it to "
     "model-00001-of-00005.safetensors"),
    ("sharded", lambda m: m.pop("layers.1.b"),
     "tensor 'layers.1.b' is in model-00004-of-00005.safetensors but the index does not list it"),
    ("sharded", lambda m: m.update({"ghost": m["big"], "spook": m["d2t"]}),
     "its weight_map lists tensors ['ghost', 'spook'], which none of its files holds"),
    ("bin_sharded", lambda m: m.update({"d2t": "pytorch_model-00002-of-00002.bin"}),
     "tensor 'd2t' is in pytorch_model-00001-of-00002.bin but the index maps it to "
     "pytorch_model-00002-of-00002.bin"),
])
def test_index_disagreeing_with_its_shards_names_the_tensor(layouts, kind, edit, needle):
    index = next(layouts[kind].glob("*.index.json"))
    data = json.loads(index.read_text())
    edit(data["weight_map"])
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        load_tensors(layouts[kind])
    assert str(e.value) == f"{index}: {needle}"


def test_unreadable_index_is_named(layouts):
    index = layouts["sharded"] / "model.safetensors.index.json"
    for text, needle in (("{bad", "not valid JSON"), ('{"metadata": {}}', "weight_map"),
                         ('{"weight_map": {"a": 1}}', "weight_map")):
        index.write_text(text)
        with pytest.raises(ValueError, match=needle) as e:
            weight_files(layouts["sharded"])
        assert str(e.value).startswith(f"{index}: ")


@pytest.mark.parametrize("kind, file", [("sharded", "model-00004-of-00005.safetensors"),
                                        ("bin_sharded", "pytorch_model-00002-of-00002.bin")])
def test_nan_tensor_is_named_with_its_file(layouts, kind, file):
    tensors = make_tensors()
    tensors["layers.1.b"][3] = float("nan")
    if kind == "sharded":
        save_folder(layouts[kind], CONFIG, tensors, torch.float32, max_shard_bytes=MAX_SHARD)
    else:
        save_bin_shards(layouts[kind], tensors)
    for fn in (load_tensors, lambda p: load_into({}, p)):
        with pytest.raises(ValueError) as e:
            fn(layouts[kind])
        assert str(e.value) == (f"{layouts[kind] / file}: tensor 'layers.1.b' holds non-finite "
                                "values (NaN or inf)")


# 300 MB of float32 in 6 shards of 2 x 25 MB. Peak memory is read from /proc (VmHWM, reset
# through clear_refs) rather than ru_maxrss, which a child started by subprocess (vfork + exec)
# inherits from the parent: pytest's own peak would hide the child's.
MEMORY_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from specdec.models.checkpoint import load_into, load_tensors, save_folder, weight_files

folder, shard = Path(sys.argv[1]), 50_000_000
names = [f"w{i:02d}" for i in range(12)]
src = {n: torch.full((2500, 2500), float(i)) for i, n in enumerate(names)}
save_folder(folder, {}, src, torch.float32, max_shard_bytes=shard)
del src
dest = {n: torch.zeros(2500, 2500) for n in names}

def mb(key):
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(l.split()[1]) for l in status if l.startswith(key + ":")) / 1024

def peak_increase(fn):
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = mb("VmRSS")
    out = fn()
    return mb("VmHWM") - before, out

into, _ = peak_increase(lambda: load_into(dest, folder))
assert all(dest[n][-1, -1].item() == i for i, n in enumerate(names))
whole, tensors = peak_increase(lambda: load_tensors(folder))
print(json.dumps({"shards": len(weight_files(folder)), "shard_mb": shard / 2**20,
                  "load_into_mb": into, "load_tensors_mb": whole}))
"""


@needs_proc
def test_load_into_peak_memory_is_one_shard(tmp_path):
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)],
                         cwd=Path(__file__).resolve().parents[1],  # this checkout's specdec
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    bound = 1.5 * got["shard_mb"]
    assert got["shards"] == 6, got
    assert got["load_into_mb"] < bound, got
    assert got["load_tensors_mb"] > bound, got  # the measure sees a whole model
