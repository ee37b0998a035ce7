"""Pages that restate the code: the README's first section (what a run leaves), its preset
table, and architecture.md's account of what a new offload tier writes against the example
in plugins.md."""
import re
from pathlib import Path

from zeroplug.plugins.workload import rundir
from zeroplug.plugins.workload.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_preset_table_lists_every_preset():
    table = README.split("## Model presets", 1)[1]
    rows = re.findall(r"^\| ([\w.]+) \| [\d.]+ B \| (\d+) \| (\d+) \| (\d+) \|$", table, re.M)
    assert {name for name, *_ in rows} == set(PRESETS) - {"char-tiny"}
    for name, layers, d_model, heads in rows:
        cfg = PRESETS[name]
        assert (cfg.n_layer, cfg.d_model, cfg.n_head) == (int(layers), int(d_model), int(heads)), name


def test_readme_first_section_says_what_a_run_leaves():
    first = README.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    for name in (rundir.CONFIG, rundir.METRICS, rundir.CHECKPOINTS, rundir.PICTURE):
        assert f"`{name}" in first, name
    assert "runs/<date>-<time>-char-tiny/" in first and "zeroplug report runs/" in first
    closing = re.findall(r"^(run saved|continue it|look at it): ", first, re.M)
    assert closing == ["run saved", "continue it", "look at it"]
    assert "--no-save" in first and "ZEROPLUG_NO_SAVE=1" in first


def test_architecture_names_what_the_plugins_example_tier_writes():
    plugins = (ROOT / "docs" / "plugins.md").read_text()
    example = plugins.split("class CompressedHost(OffloadTier):", 1)[1].split("@hookimpl", 1)[0]
    written = set(re.findall(r"^    def (\w+)\(", example, re.M)) | set(re.findall(r"^    (\w+) = property", example, re.M))
    assert written == {"acquire", "release", "plan", "device", "capabilities"}
    arch = (ROOT / "docs" / "architecture.md").read_text()
    sentence = arch.split("so a new tier writes", 1)[1].split("The built-in ones override the loop", 1)[0]
    assert all(f"`{name}`" in sentence for name in written), sentence
