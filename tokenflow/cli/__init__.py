"""The `tokenflow` commands: serve, simulate (one engine or a fleet), bench, profile, tune,
and the config file they share."""
