"""Configuration: the typed, validated dataclasses (schema.py) and Hydra's composition of conf/ plus
command-line overrides into them (compose.py)."""
