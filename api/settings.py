"""The service's settings: the one `tuner.settings.Settings`, read from the environment once at
startup; a bad value fails there with the variable's name and the fix."""

from tuner.settings import Settings, SettingsError

__all__ = ["Settings", "SettingsError"]
