"""Settings: verl's dotted config keys, their defaults, and how a run's config is resolved."""

from rldiag.config.settings import DEFAULTS, Settings, parse_override, resolve_settings, scenario_slug

__all__ = ["DEFAULTS", "Settings", "parse_override", "resolve_settings", "scenario_slug"]
