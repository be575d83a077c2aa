"""Model tests: configs, checkpoint loading and sharding, start-up checks and the vision tower against transformers."""
