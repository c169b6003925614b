"""Finding and loading plugins: the ``vlmreg`` entry-point group, ``VLMREG_PLUGINS``, hook validation.

Plugins load lazily, once per process, the first time the registry is asked for anything. Every
failure names the distribution and entry point at fault, so a user knows what to fix, uninstall,
or leave out with ``VLMREG_PLUGINS``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from typing import Any

import attrs
import pluggy

from vlmreg.sdk import hookspecs
from vlmreg.sdk.errors import PluginError, VlmregError, did_you_mean
from vlmreg.sdk.version import __version__

__all__ = ["ENTRY_POINT_GROUP", "ENV_VAR", "PluginHost", "PluginInfo"]

ENTRY_POINT_GROUP = "vlmreg"
ENV_VAR = "VLMREG_PLUGINS"
#: Plugins shipped inside vlmreg itself; loaded always (VLMREG_PLUGINS selects among installed ones).
BUILTIN_PLUGINS = {
    "vlmreg.tasks": "vlmreg.builtin.tasks",
    "vlmreg.objectives": "vlmreg.builtin.objectives",
    "vlmreg.engines": "vlmreg.builtin.engines",
    "vlmreg.sinks": "vlmreg.builtin.sinks",
    "vlmreg.rewards": "vlmreg.builtin.rewards",
    "vlmreg.transports": "vlmreg.builtin.transports",
    "vlmreg.environments": "vlmreg.builtin.environments",
}
_HOOK_PREFIX = "vlmreg_"


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what is written to standard output to standard error for the duration: Python's ``print`` and writes to
    file descriptor 1 alike (a plugin's C extension, or ``os.write(1, ...)``), so ``--json`` output stays JSON."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedded interpreter): Python-level redirection only
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class PluginInfo:
    """Where a registered plugin came from."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None

    @property
    def origin(self) -> str:
        """A short human description: ``distribution 'x' (entry point 'a = b')`` or ``plugin 'x'``."""
        if self.distribution is None:
            return f"plugin {self.name!r} (registered in process)"
        return f"distribution {self.distribution!r} (entry point '{self.entry_point}')"


def _selected_names() -> set[str] | None:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return None
    return {_normalise(part) for part in raw.split(",") if part.strip()}


#: Each ``sys.path`` folder's distributions with ``vlmreg`` entry points, as this process first read them.
_READ: dict[str, list[tuple[str, list[metadata.EntryPoint]]]] = {}


def _installed_at(entry: str) -> list[tuple[str, list[metadata.EntryPoint]]]:
    """The distributions in one ``sys.path`` folder (normalised name, its ``vlmreg`` entry points), read once per
    process.

    Python itself reads a folder's ``.pth`` files once, at start: a plugin ``pip install``-ed while a process runs
    (``-e`` above all, whose source folder joins ``sys.path`` only through a ``.pth`` file) may not even be importable
    in it. So the set of installed plugins is fixed per folder when the process first reads that folder: reloading
    the registry (`vlmreg.reset_registry`, between tests) sees the same plugins, and the next process sees the new
    one. A folder added to ``sys.path`` later is read when it is first seen.
    """
    if entry not in _READ:
        found = []
        for dist in metadata.distributions(path=[entry]):
            name = dist.metadata["Name"]
            if name:
                found.append((_normalise(name), list(dist.entry_points.select(group=ENTRY_POINT_GROUP))))
        _READ[entry] = found
    return _READ[entry]


def _entry_points() -> list[metadata.EntryPoint]:
    """The ``vlmreg`` entry points of the installed distributions, in ``sys.path`` order; a distribution found in two
    folders is the first one's (as `importlib.metadata.entry_points`)."""
    names: set[str] = set()
    found = []
    for entry in list(sys.path):
        if not isinstance(entry, str):
            continue
        for name, eps in _installed_at(entry):
            if name not in names:
                names.add(name)
                found += eps
    return found


class PluginHost:
    """A pluggy `PluginManager` for the ``vlmreg_*`` hooks, plus where each plugin came from."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}

    # -- loading ---------------------------------------------------------------------------
    def load_builtins(self) -> None:
        """Register vlmreg's own plugins, through the same hooks a third party uses."""

        for name, module in BUILTIN_PLUGINS.items():
            info = PluginInfo(
                name=name, distribution="vlmreg", version=__version__, entry_point=f"{name} = {module} (built in)"
            )
            self.register(importlib.import_module(module), info)

    def load_entry_points(self) -> None:
        """Load every plugin of the ``vlmreg`` group, or only those ``VLMREG_PLUGINS`` names."""
        eps = _entry_points()
        selected = _selected_names()
        if selected is not None:
            available = {_normalise(ep.name) for ep in eps} | {_normalise(ep.dist.name) for ep in eps if ep.dist}
            for name in sorted(selected - available):
                listing = ", ".join(sorted({ep.name for ep in eps})) or "none"
                raise PluginError(
                    f"{ENV_VAR} names {name!r}, which no installed plugin provides.{did_you_mean(name, available)} "
                    f"Installed plugins: {listing}"
                )
            eps = [
                ep
                for ep in eps
                if _normalise(ep.name) in selected or (ep.dist and _normalise(ep.dist.name) in selected)
            ]
        for ep in eps:
            dist = ep.dist
            info = PluginInfo(
                name=ep.name,
                distribution=dist.name if dist else "(unknown distribution)",
                version=dist.version if dist else None,
                entry_point=f"{ep.name} = {ep.value}",
            )
            try:
                with stdout_to_stderr():  # a plugin's output never reaches `--json` output
                    plugin = ep.load()
            except VlmregError as exc:
                raise PluginError(f"{info.origin} failed to load: {exc}") from exc
            except (SystemExit, KeyboardInterrupt) as exc:  # never a silent exit 0 from a plugin's import
                raise PluginError(
                    f"{info.origin} raised {type(exc).__name__}({exc}) while importing. "
                    f"Fix or uninstall it, or leave it out with {ENV_VAR}=<the plugins you want>."
                ) from exc
            except Exception as exc:
                raise PluginError(
                    f"{info.origin} failed to import: {type(exc).__name__}: {exc}. "
                    f"Fix or uninstall it, or leave it out with {ENV_VAR}=<the plugins you want>."
                ) from exc
            self.register(plugin, info)
        self.check()

    def register(self, plugin: Any, info: PluginInfo) -> None:
        """Register one plugin object under ``info.name``; a clash or a bad hook names the distribution."""
        if info.name in self.infos:
            other = self.infos[info.name]
            raise PluginError(f"two plugins are named {info.name!r}: {other.origin} and {info.origin}")
        _check_undecorated(plugin, info)
        try:
            self.manager.register(plugin, name=info.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{info.origin} does not follow the hook contract: {_one_line(exc)}") from exc
        except ValueError as exc:  # the same object registered twice
            raise PluginError(f"{info.origin} could not be registered: {exc}") from exc
        self.infos[info.name] = info
        if not self.hooks_of(info.name):
            self.manager.unregister(name=info.name)
            del self.infos[info.name]
            raise PluginError(
                f"{info.origin} implements no vlmreg hook; decorate its functions with @vlmreg.hookimpl "
                f"(hooks: {', '.join(self.hook_names())})"
            )

    def unregister(self, name: str) -> None:
        self.manager.unregister(name=name)
        self.infos.pop(name, None)

    def check(self) -> None:
        """Fail on a hook implementation whose name is not a vlmreg hook (a misspelling, usually)."""
        try:
            self.manager.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.manager.get_name(exc.plugin)
            info = self.infos.get(name or "", PluginInfo(name=str(name)))
            raise PluginError(f"{info.origin}: {_one_line(exc)}.{_hook_hint(str(exc), self.hook_names())}") from exc

    # -- questions -------------------------------------------------------------------------
    def hook_names(self) -> list[str]:
        """The hooks vlmreg defines (pluggy also keeps callers for unknown names it has seen)."""
        return sorted(
            n
            for n in dir(self.manager.hook)
            if n.startswith(_HOOK_PREFIX) and getattr(self.manager.hook, n).spec is not None
        )

    def hooks_of(self, name: str) -> list[str]:
        plugin = self.manager.get_plugin(name)
        callers = self.manager.get_hookcallers(plugin) or []
        return sorted(c.name for c in callers)

    def call_each(self, hook: str, make_kwargs: Callable[[PluginInfo], dict[str, Any]]) -> None:
        """Call ``hook`` through pluggy, with arguments made for whichever plugin is running.

        pluggy calls the implementations in its own order (``tryfirst`` / ``trylast``, then the last registered
        first; ``wrapper=True`` implementations around the rest). For the length of the call each implementation is
        wrapped so that it marks itself as running: each argument is a dispatcher that sends a plugin's call to the
        callable ``make_kwargs(that plugin's info)`` made, so a ``register`` callback knows which distribution
        registers, and an exception names the plugin whose implementation raised it.
        """
        caller = getattr(self.manager.hook, hook)
        made: dict[str, dict[str, Any]] = {}

        def dispatcher(key: str) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                info = _RUNNING.get()
                if info is None:
                    raise PluginError(
                        f"a {hook} callback was called after the hook returned (keep it only for the call)"
                    )
                if info.name not in made:
                    made[info.name] = make_kwargs(info)
                return made[info.name][key](*args, **kwargs)

            return call

        arguments = {key: dispatcher(key) for key in make_kwargs(PluginInfo(name="(probe)"))}
        impls = caller.get_hookimpls()
        originals = [(impl, impl.function) for impl in impls]
        for impl, function in originals:
            impl.function = _marked(function, self.infos[impl.plugin_name])
        try:
            with stdout_to_stderr():
                caller(**arguments)
        except PluginError:
            raise
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            info = getattr(exc, "_vlmreg_plugin", None)
            origin = info.origin if info is not None else f"a plugin implementing {hook}"
            if isinstance(exc, SystemExit | KeyboardInterrupt):
                raise PluginError(f"{origin} raised {type(exc).__name__}({exc}) in {hook}") from exc
            if isinstance(exc, VlmregError):
                raise PluginError(f"{origin}, in {hook}: {exc}") from exc
            raise PluginError(f"{origin} raised in {hook}: {type(exc).__name__}: {exc}") from exc
        finally:
            for impl, function in originals:
                impl.function = function


_RUNNING: contextvars.ContextVar[PluginInfo | None] = contextvars.ContextVar("vlmreg_running_plugin", default=None)


def _blame(exc: BaseException, info: PluginInfo) -> None:
    """Remember the innermost plugin an exception passed through."""
    if getattr(exc, "_vlmreg_plugin", None) is None:
        try:
            exc._vlmreg_plugin = info  # type: ignore[attr-defined]
        except AttributeError:
            pass


def _marked(function: Callable[..., Any], info: PluginInfo) -> Callable[..., Any]:
    """``function`` running as ``info``'s (a generator function, for ``wrapper=True``, stays one)."""
    if inspect.isgeneratorfunction(function):

        def generator(*args: Any) -> Any:
            token = _RUNNING.set(info)
            try:
                return (yield from function(*args))
            except BaseException as exc:
                _blame(exc, info)
                raise
            finally:
                _RUNNING.reset(token)

        return generator

    def plain(*args: Any) -> Any:
        token = _RUNNING.set(info)
        try:
            return function(*args)
        except BaseException as exc:
            _blame(exc, info)
            raise
        finally:
            _RUNNING.reset(token)

    return plain


def _check_undecorated(plugin: Any, info: PluginInfo) -> None:
    opts_attr = hookspecs.PROJECT + "_impl"
    for attr in dir(plugin):
        if (
            attr.startswith(_HOOK_PREFIX)
            and callable(getattr(plugin, attr, None))
            and not hasattr(getattr(plugin, attr), opts_attr)
        ):
            raise PluginError(f"{info.origin}: function {attr!r} is not decorated with @vlmreg.hookimpl")


def _one_line(exc: Exception) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _hook_hint(message: str, hooks: Iterable[str]) -> str:
    match = re.search(r"(vlmreg_\w+)", message)
    return did_you_mean(match.group(1), hooks) if match else ""
