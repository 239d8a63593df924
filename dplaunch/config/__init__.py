"""Run configuration: the YAML schema and its loading with flag/--set overrides."""
