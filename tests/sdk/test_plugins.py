"""Plugin loading through real entry points: third-party families, and every way a plugin can be wrong."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import vlmreg
from vlmreg import FamilyDescriptor, PluginError, RegistryConflictError, UnknownFamilyError, hookimpl
from vlmreg.cli import main, output
from vlmreg.sdk.registry import get_plugin_host, get_registry, reset_registry

FAMILY_PLUGIN = """
from vlmreg import FamilyDescriptor, hookimpl

LOADS = []
LOADS.append(1)


def tiny_config():
    raise NotImplementedError


@hookimpl
def vlmreg_register_families(register):
    register(FamilyDescriptor(
        name={name!r}, model_types=[{model_type!r}], vision_encoder_attr="model.vision_tower",
        language_model_attr="model.language_model", lm_head_attr="lm_head", tiny_config=tiny_config,
    ))
"""


def family_plugin(name: str, model_type: str) -> str:
    return FAMILY_PLUGIN.format(name=name, model_type=model_type)


def test_a_third_party_distribution_is_listed_with_its_distribution_and_version(make_distribution):
    module = make_distribution("acme-vlm", family_plugin("acme", "acme_vl"), version="2.3")
    registry = get_registry()
    assert registry.get("acme").model_types == ("acme_vl",)
    assert registry.for_model_type("acme_vl").name == "acme"
    plugin = registry.plugin_of("acme")
    assert (plugin.distribution, plugin.version, plugin.entry_point) == ("acme-vlm", "2.3", f"acme_vlm = {module}")
    assert get_plugin_host().hooks_of("acme_vlm") == ["vlmreg_register_families"]


def test_plugins_load_lazily_and_once(make_distribution):
    module = make_distribution("acme-vlm", family_plugin("acme", "acme_vl"))
    assert module not in sys.modules
    get_registry()
    get_registry()
    vlmreg.get_family("acme")
    assert sys.modules[module].LOADS == [1]


def test_a_plugin_that_fails_to_import_names_its_distribution_and_entry_point(make_distribution, monkeypatch):
    make_distribution("acme-vlm", family_plugin("acme", "acme_vl"))
    module = make_distribution("broken-vlm", "import no_such_package_anywhere\n")
    with pytest.raises(PluginError) as info:
        get_registry()
    message = str(info.value)
    assert "distribution 'broken-vlm'" in message and f"broken_vlm = {module}" in message
    assert "ModuleNotFoundError" in message and "VLMREG_PLUGINS" in message

    monkeypatch.setenv("VLMREG_PLUGINS", "acme-vlm")  # a distribution name works as well as an entry-point name
    vlmreg.reset_registry()
    assert get_registry().names() == ["acme"]


def test_vlmreg_plugins_empty_loads_nothing(make_distribution, monkeypatch):
    make_distribution("acme-vlm", family_plugin("acme", "acme_vl"))
    monkeypatch.setenv("VLMREG_PLUGINS", "")
    assert len(get_registry()) == 0
    with pytest.raises(UnknownFamilyError, match="Installed families: none"):
        get_registry().get("acme")


def test_vlmreg_plugins_naming_something_not_installed_is_an_error(make_distribution, monkeypatch):
    make_distribution("acme-vlm", family_plugin("acme", "acme_vl"))
    monkeypatch.setenv("VLMREG_PLUGINS", "acme_vml")
    with pytest.raises(
        PluginError,
        match="VLMREG_PLUGINS names 'acme-vml', which no installed plugin provides. Did you mean 'acme-vlm'",
    ):
        get_registry()


def test_a_misspelled_hook_is_an_error_with_a_suggestion(make_distribution):
    make_distribution(
        "typo-vlm",
        """
        from vlmreg import hookimpl

        @hookimpl
        def vlmreg_register_familes(register):
            pass
        """,
    )
    with pytest.raises(PluginError) as info:
        get_registry()
    assert "distribution 'typo-vlm'" in str(info.value)
    assert "vlmreg_register_familes" in str(info.value) and "Did you mean 'vlmreg_register_families'" in str(info.value)


def test_a_hook_without_the_decorator_is_an_error(make_distribution):
    make_distribution("plain-vlm", "def vlmreg_register_families(register):\n    pass\n")
    with pytest.raises(
        PluginError, match="'plain-vlm'.*'vlmreg_register_families' is not decorated with @vlmreg.hookimpl"
    ):
        get_registry()


def test_a_hook_with_a_wrong_argument_is_an_error(make_distribution):
    make_distribution(
        "args-vlm",
        """
        from vlmreg import hookimpl

        @hookimpl
        def vlmreg_register_families(register, config):
            pass
        """,
    )
    with pytest.raises(PluginError, match="'args-vlm'.*does not follow the hook contract.*config"):
        get_registry()


def test_two_distributions_claiming_one_model_type_are_both_named(make_distribution):
    make_distribution("first-vlm", family_plugin("first", "shared_vl"))
    make_distribution("second-vlm", family_plugin("second", "shared_vl"))
    with pytest.raises(RegistryConflictError) as info:
        get_registry()
    message = str(info.value)
    assert "model_type 'shared_vl'" in message
    assert "distribution 'first-vlm'" in message and "distribution 'second-vlm'" in message


def test_a_family_name_registered_twice_is_an_error(make_distribution):
    make_distribution("first-vlm", family_plugin("same", "first_vl"))
    make_distribution("second-vlm", family_plugin("same", "second_vl"))
    with pytest.raises(RegistryConflictError, match="family 'same' is registered twice") as info:
        get_registry()
    assert "distribution 'first-vlm'" in str(info.value) and "distribution 'second-vlm'" in str(info.value)


def test_a_bundled_model_type_cannot_be_taken_over(make_distribution):
    make_distribution("impostor-vlm", family_plugin("impostor", "qwen3_vl"))
    with pytest.raises(RegistryConflictError, match="model_type 'qwen3_vl' is claimed by family") as info:
        get_registry()
    assert "family 'qwen3_vl' from distribution 'vlmreg-qwen3-vl'" in str(info.value)
    assert "family 'impostor' from distribution 'impostor-vlm'" in str(info.value)


def test_a_bad_descriptor_names_the_distribution_and_the_field(make_distribution):
    make_distribution(
        "bad-vlm", family_plugin("bad", "bad_vl").replace('lm_head_attr="lm_head"', 'lm_head_attr="lm head"')
    )
    with pytest.raises(PluginError, match="distribution 'bad-vlm'.*FamilyDescriptor 'bad': field 'lm_head_attr'"):
        get_registry()


def test_an_exception_inside_the_hook_names_the_distribution(make_distribution):
    make_distribution(
        "raising-vlm",
        """
        from vlmreg import hookimpl

        @hookimpl
        def vlmreg_register_families(register):
            {}["missing"]
        """,
    )
    with pytest.raises(PluginError, match="distribution 'raising-vlm'.*raised in vlmreg_register_families: KeyError"):
        get_registry()


def test_register_takes_only_descriptors(make_distribution):
    make_distribution(
        "wrong-vlm",
        """
        from vlmreg import hookimpl

        @hookimpl
        def vlmreg_register_families(register):
            register({"name": "wrong"})
        """,
    )
    with pytest.raises(
        PluginError, match="'wrong-vlm'.*called register\\(\\) with a dict; it takes a vlmreg.FamilyDescriptor"
    ):
        get_registry()


def test_a_plugin_with_no_hooks_is_an_error(make_distribution):
    make_distribution("empty-vlm", "VALUE = 1\n")
    with pytest.raises(PluginError, match="'empty-vlm'.*implements no vlmreg hook"):
        get_registry()


def test_in_process_plugins_register_and_unregister(vlmreg_fresh_registry):
    plugin = types.SimpleNamespace()

    @hookimpl
    def vlmreg_register_families(register):
        register(
            FamilyDescriptor(
                name="notebook",
                model_types=["nb_vl"],
                vision_encoder_attr="v",
                language_model_attr="l",
                lm_head_attr="h",
                tiny_config=dict,
            )
        )

    plugin.vlmreg_register_families = vlmreg_register_families
    info = vlmreg.register_plugin(plugin, name="notebook-plugin")
    try:
        assert info.origin == "plugin 'notebook-plugin' (registered in process)"
        assert vlmreg.get_family("notebook").model_types == ("nb_vl",)
        with pytest.raises(PluginError, match="already registered"):
            vlmreg.register_plugin(plugin, name="notebook-plugin")
    finally:
        vlmreg.unregister_plugin("notebook-plugin")
    with pytest.raises(UnknownFamilyError, match="Unknown family 'notebook'"):
        vlmreg.get_family("notebook")


def test_unknown_family_suggests_and_lists(vlmreg_fresh_registry):
    with pytest.raises(UnknownFamilyError) as info:
        vlmreg.get_family("qwen3vl")
    message = str(info.value)
    assert "Did you mean 'qwen3_vl'" in message
    assert "qwen3_5_moe (qwen3_5_moe)" in message and "Install a plugin" in message


def test_a_plugin_that_exits_at_import_is_an_error_naming_its_distribution(make_distribution):
    """`sys.exit(0)` in a plugin's import must not end `vlmreg families` silently with exit 0 (issue 11)."""
    module = make_distribution("quitter-vlm", "import sys\nsys.exit(0)\n")
    with pytest.raises(PluginError) as info:
        get_registry()
    message = str(info.value)
    assert (
        "distribution 'quitter-vlm'" in message and f"quitter_vlm = {module}" in message and "SystemExit(0)" in message
    )


def test_a_plugin_that_prints_never_reaches_stdout(make_distribution, capsys):
    """A plugin's prints at import or registration go to stderr, so `vlmreg families --json` stays JSON."""

    source = "print('hello from import')\n" + family_plugin("acme", "acme_vl").replace(
        "def vlmreg_register_families(register):",
        "def vlmreg_register_families(register):\n    print('hello from the hook')",
    )
    make_distribution("chatty-vlm", source)
    assert main(["families", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "acme" in {r["name"] for r in json.loads(out)}
    assert "hello from import" in err and "hello from the hook" in err


def test_a_plugin_that_writes_to_file_descriptor_1_never_reaches_stdout(make_distribution, capfd):
    """Writes below Python's print (a C extension, `os.write(1, ...)`) are redirected too: a real process's stdout."""

    source = "import os\nos.write(1, b'raw bytes from import\\n')\n" + family_plugin("acme", "acme_vl")
    make_distribution("raw-vlm", source)
    assert main(["families", "--json"]) == 0
    out, err = capfd.readouterr()
    assert "acme" in {r["name"] for r in json.loads(out)}
    assert "raw bytes from import" in err and "raw bytes" not in out


# -- a plugin's text is printed as text, never as rich markup (issue 11) -----------------------------------------
MARKUP_TEXTS = [
    "closing [/x] tag",
    "[bold]loud[/bold] and [red]red",
    "needs [data] paths",
    "[link=file:///etc/passwd]click[/link]",
    r"C:\path\[/x]",
    "ends with a backslash \\",
]
EXAMPLE_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_vl_tiny.toml")


def _printed(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "MarkupError" not in err and "unexpected" not in err
    return code, out, err


@pytest.mark.parametrize("text", MARKUP_TEXTS)
@pytest.mark.parametrize(
    "argv",
    [
        ["families"],
        ["families", "--json"],
        ["plugins"],
        ["show", "qwen3_vl"],
        ["check", "qwen3_vl"],
        ["data", "tasks"],
        ["validate", EXAMPLE_CONFIG],
    ],
)
def test_a_plugin_error_that_looks_like_markup_is_printed_verbatim(make_distribution, capsys, monkeypatch, argv, text):
    monkeypatch.setenv("VLMREG_PLUGINS", "qwen3_vl,markup-vlm")  # only these: other installed plugins cannot interfere
    make_distribution("markup-vlm", f"raise RuntimeError({text!r})\n")
    code, out, err = _printed(capsys, argv)
    assert code == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line: soft-wrapped, never folded
    assert f"RuntimeError: {text}" in err and "distribution 'markup-vlm'" in err


@pytest.mark.parametrize("text", MARKUP_TEXTS)
def test_a_plugin_error_inside_its_hook_that_looks_like_markup_is_printed_verbatim(
    make_distribution, capsys, monkeypatch, text
):
    monkeypatch.setenv("VLMREG_PLUGINS", "qwen3_vl,hooked-vlm")
    make_distribution(
        "hooked-vlm",
        "from vlmreg import hookimpl\n\n@hookimpl\ndef vlmreg_register_families(register):\n    raise "
        f"ValueError({text!r})\n",
    )
    code, _, err = _printed(capsys, ["families"])
    assert code == 1 and f"ValueError: {text}" in err and "distribution 'hooked-vlm'" in err


@pytest.mark.parametrize("text", MARKUP_TEXTS)
def test_a_plugin_s_own_strings_that_look_like_markup_are_printed_verbatim(
    make_distribution, capsys, tmp_path, monkeypatch, text
):
    """What a plugin declares (its distribution's version, a family's description) reaches tables and `show` as text."""

    monkeypatch.setattr(output.stdout, "_width", 400)  # wide enough that no table cell is folded
    monkeypatch.setenv("VLMREG_PLUGINS", "qwen3_vl,acme-vlm")
    source = family_plugin("acme", "acme_vl").replace(
        "tiny_config=tiny_config,", f"tiny_config=tiny_config, description={text!r},"
    )
    make_distribution("acme-vlm", source)
    version = "1.0[/x][bold]b"  # metadata is whatever the distribution says
    (tmp_path / "site" / "acme_vlm-1.0.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: acme-vlm\nVersion: {version}\n"
    )
    for argv in (["families"], ["plugins"], ["show", "acme"]):
        code, out, _ = _printed(capsys, argv)
        assert code == 0 and version in out, (argv, out)
    code, out, _ = _printed(capsys, ["show", "acme"])
    assert text in out


def _late_install(site: Path, src: Path, name: str) -> None:
    """What ``pip install -e`` leaves in a site folder: a .dist-info with the entry point and a .pth naming ``src``,
    where the module is (the module itself is not in ``site``, so it imports only once the .pth has been read)."""
    (src / f"vlmreg_{name}.py").write_text(family_plugin(name, f"{name}_vl"))
    info = site / f"vlmreg_{name}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vlmreg-{name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[vlmreg]\n{name} = vlmreg_{name}\n")
    (site / f"__editable__.vlmreg_{name}.pth").write_text(f"{src}\n")


def test_a_plugin_installed_while_the_process_runs_changes_nothing_until_the_next_process(
    tmp_path, monkeypatch, vlmreg_fresh_registry
):
    """Issue 31 item 6: a `pip install -e` during a test run made every later registry load fail (its module is not
    importable before the .pth is read at the next start); now the process keeps the plugins it first read."""

    site, src = tmp_path / "site", tmp_path / "src"
    site.mkdir()
    src.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = get_registry().names()
    _late_install(site, src, "late")
    for _ in range(2):  # a test run resets the registry between tests: each reload sees the same plugins
        reset_registry()
        assert get_registry().names() == before
    assert "late" not in {info.name for info in get_plugin_host().infos.values()}
    # the next process reads the .pth and loads the plugin
    code = f"import site; site.addsitedir({str(site)!r}); from vlmreg.cli import main; main(['families', '--json'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert {f["name"]: f["plugin"] for f in json.loads(out)}["late"] == "vlmreg-late"


def test_a_plugin_importable_at_once_also_waits_for_the_next_process(tmp_path, monkeypatch, vlmreg_fresh_registry):
    """A plain (not editable) install is importable at once; the set of plugins still stays what the process read."""

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = get_registry().names()
    _late_install(site, site, "plain")
    reset_registry()
    assert get_registry().names() == before
    fresh = tmp_path / "fresh"  # a folder first seen after the install (as a new process would see `site`) is read
    fresh.mkdir()
    _late_install(fresh, fresh, "fresh")
    monkeypatch.syspath_prepend(str(fresh))
    reset_registry()
    assert set(get_registry().names()) == {*before, "fresh"}
