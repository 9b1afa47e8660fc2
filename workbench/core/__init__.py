"""Torch-free leaves every layer may import: errors, config (TOML schema), flavors, neuron_env (LNC), moe_blocks."""
