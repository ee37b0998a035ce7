"""`zeroplug --help` and the commands' own help start without torch: the command line loads
only the plugins that add commands (zeroplug.registry.command_plugin_manager). How long it
takes is measured by hand (`time zeroplug --help`), not here; what makes it fast is asserted."""
import subprocess
import sys
from importlib import metadata

import pytest

from zeroplug.registry import COMMANDS_GROUP, ENTRY_POINT_GROUP

#: prints the modules the command line imported, after its own output
PROBE = ("import sys\nfrom zeroplug.cli import main\ncode = main(sys.argv[1:])\n"
         "print('IMPORTED', ' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
         "('torch', 'zeroplug', 'numpy'))))\nsys.exit(code)")


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["report", "--help"], ["tune", "--help"],
                                  ["train", "--steps", "0"], ["report", "missing.csv"]])
def test_help_and_argument_errors_do_not_import_torch(argv, tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode in (0, 2), out.stderr[-2000:]
    if out.returncode == 2:         # one error line, no traceback
        assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    imported = out.stdout.rsplit("IMPORTED", 1)[1].split()
    assert "torch" not in imported and "numpy" not in imported, imported
    assert "zeroplug.plugins.zero" not in imported          # the stages are not loaded to list commands
    if argv[0] == "--help":
        assert "train" in out.stdout and "report" in out.stdout


def test_every_builtin_plugin_that_adds_commands_is_in_the_commands_group():
    """A built-in plugin with zeroplug_add_commands outside the group would vanish from the
    command line (third-party plugins need no declaration: they all load)."""
    declared = {ep.name for ep in metadata.entry_points(group=COMMANDS_GROUP)}
    adds = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
            if ep.dist is not None and ep.dist.name == "zeroplug" and hasattr(ep.load(), "zeroplug_add_commands")}
    assert adds == declared == {"workload"}


def test_lazy_names_of_the_package_resolve():
    import zeroplug
    for name in zeroplug.__all__:
        assert getattr(zeroplug, name) is not None
    assert zeroplug.tiers.OffloadTier is not None          # a submodule read as an attribute
    with pytest.raises(AttributeError):
        zeroplug.no_such_name
