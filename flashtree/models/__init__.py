"""Target and drafter models: checkpoint loading, configs, decoder layers."""
