"""Plugins: installed packages that declare an entry point in group `strata.plugins`.

Each entry point names a `register()` callable; Strata calls it once per process when the first engine
(or `strata layers`) starts, so it can register out-of-tree layers or a platform. `STRATA_PLUGINS=a,b`
restricts which load (empty: none); `STRATA_PLUGINS_STRICT=0` turns a failing plugin into a warning.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from strata import envs
from strata.custom_op import registering_plugin

logger = logging.getLogger("strata.plugins")

PLUGIN_GROUP = "strata.plugins"

_loaded: list[str] | None = None


class PluginError(ValueError):
    """A plugin named in STRATA_PLUGINS is not installed, or an installed plugin failed to load."""


def load_plugins() -> list[str]:
    """Load the selected plugins (once per process); returns the names of those loaded."""
    global _loaded
    if _loaded is not None:
        return _loaded
    selected = envs.plugins_default()
    strict = envs.plugins_strict_default()
    available = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    names = sorted(available) if selected is None else selected
    loaded = []
    for name in names:
        try:
            if name not in available:
                raise PluginError(
                    f"STRATA_PLUGINS names plugin {name!r}, which is not installed; "
                    f"installed: {', '.join(sorted(available)) or 'none'}"
                )
            with registering_plugin(name):
                available[name].load()()
        except Exception as exc:  # a plugin can fail in any way; name it instead of surfacing a bare trace
            message = f"plugin {name!r} failed to load: {exc}"
            if strict:
                raise PluginError(message + " (STRATA_PLUGINS_STRICT=0 skips it with a warning)") from exc
            logger.warning("%s; skipped because STRATA_PLUGINS_STRICT=0", message)
            continue
        loaded.append(name)
    if loaded:
        logger.info("loaded plugins: %s", ", ".join(loaded))
    _loaded = loaded
    return loaded
